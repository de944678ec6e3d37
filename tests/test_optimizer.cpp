// The optimizer as a value: every family builds, its state is read and rebuilt without knowing
// the family, its bytes are measured (not assumed), and bad hyperparameters are named.
#include "test_util.h"

namespace memfit {
namespace {

OptimizerSpec spec_of(OptimizerFamily family, double momentum = 0) {
  OptimizerSpec s;
  s.family = family;
  s.momentum = momentum;
  return s;
}

// A small model with one step taken, so that every family has made its state.
struct Stepped {
  std::shared_ptr<torch::nn::LinearImpl> model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  explicit Stepped(const OptimizerSpec& spec) {
    torch::manual_seed(0);
    model = std::make_shared<torch::nn::LinearImpl>(16, 8);
    optimizer = make_optimizer(spec, model->parameters());
    model->forward(torch::randn({4, 16})).pow(2).mean().backward();
    optimizer->step();
  }
};

TEST(OptimizerTest, StateBytesAreMeasuredPerFamily) {
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  auto model = std::make_shared<torch::nn::LinearImpl>(64, 32);
  const int64_t bytes = parameter_bytes(*model);
  const std::pair<OptimizerSpec, int64_t> expected[] = {
      {spec_of(OptimizerFamily::kAdamW), 2 * bytes},     {spec_of(OptimizerFamily::kAdam), 2 * bytes},
      {spec_of(OptimizerFamily::kSGD, 0.9), bytes},      {spec_of(OptimizerFamily::kSGD), 0},
      {spec_of(OptimizerFamily::kRMSprop), bytes},       {spec_of(OptimizerFamily::kRMSprop, 0.9), 2 * bytes},
      {spec_of(OptimizerFamily::kAdagrad), bytes}};
  const at::Tensor before = model->weight.detach().clone();
  for (const auto& [spec, state] : expected) {
    const OptimizerCost cost = measure_optimizer(spec, model->parameters(), *tracker);
    EXPECT_EQ(cost.state_bytes, state) << spec.describe();
    EXPECT_TRUE(model->weight.equal(before)) << spec.describe() << ": measuring must leave the weights as they were";
    EXPECT_FALSE(model->weight.grad().defined());
  }
}

TEST(OptimizerTest, StateReadAndRebuiltForEveryFamily) {
  for (auto family : {OptimizerFamily::kAdamW, OptimizerFamily::kAdam, OptimizerFamily::kSGD, OptimizerFamily::kRMSprop,
                      OptimizerFamily::kAdagrad}) {
    Stepped a(spec_of(family, family == OptimizerFamily::kSGD ? 0.9 : 0));
    ASSERT_FALSE(a.optimizer->state().empty()) << optimizer_family_name(family);
    for (const auto& p : a.model->parameters()) {
      const auto& state = *a.optimizer->state().at(param_state_key(p));
      const ParamStateRecord r = read_param_state(state);
      ASSERT_EQ(r.tensors.size(), param_state_slots(family));
      const ParamStateRecord back = read_param_state(*make_param_state(family, r));
      EXPECT_EQ(back.step, r.step);
      for (size_t i = 0; i < r.tensors.size(); ++i) {
        EXPECT_EQ(back.tensors[i].defined(), r.tensors[i].defined());
        if (r.tensors[i].defined()) EXPECT_TRUE(back.tensors[i].equal(r.tensors[i]));
      }
    }
    EXPECT_FALSE(optimizer_state_tensors(*a.optimizer).empty());
  }
}

TEST(OptimizerTest, SpecJsonRoundTripsAndBadValuesAreNamed) {
  OptimizerSpec s = spec_of(OptimizerFamily::kSGD, 0.9);
  s.lr = 0.05;
  s.weight_decay = 1e-4;
  const OptimizerSpec back = optimizer_spec_from_json(optimizer_spec_json(s));
  EXPECT_EQ(optimizer_spec_json(back), optimizer_spec_json(s));
  auto option_of = [](const OptimizerSpec& bad) {
    try {
      check_optimizer_spec(bad);
    } catch (const OptionError& e) {
      return e.option();
    }
    return std::string("(accepted)");
  };
  OptimizerSpec bad = s;
  bad.lr = std::numeric_limits<double>::infinity();
  EXPECT_EQ(option_of(bad), "optimizer.lr");
  bad = spec_of(OptimizerFamily::kAdam, 0.9);
  EXPECT_EQ(option_of(bad), "optimizer.momentum");  // momentum does not apply to Adam
  bad = spec_of(OptimizerFamily::kSGD);
  bad.beta1 = 0.5;
  EXPECT_EQ(option_of(bad), "optimizer.betas");
  EXPECT_THROW(parse_optimizer_family("lamb"), OptionError);
}

TEST(StepConfigTest, JsonRoundTripsAndIsChecked) {
  StepConfig c;
  c.batch = 12;
  c.micro_batch = 5;
  c.precision = Precision::kBF16;
  c.checkpoint = CheckpointPlan::every(2, 6);
  c.set_to_none = false;
  c.optimizer = spec_of(OptimizerFamily::kRMSprop, 0.5);
  EXPECT_EQ(c.accumulation(), 3);
  const StepConfig back = step_config_from_json(step_config_json(c), 6);
  EXPECT_EQ(step_config_json(back), step_config_json(c));
  StepConfig bad = c;
  bad.micro_batch = 13;
  EXPECT_THROW(check_step_config(bad, 6), OptionError);
  EXPECT_THROW(step_config_from_json(step_config_json(c), 3), OptionError);  // segments past the chain
}

}  // namespace
}  // namespace memfit
