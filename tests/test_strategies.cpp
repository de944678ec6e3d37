// Every strategy (strategy.h) against single-process training, through the Strategy interface
// alone, as the Trainer drives it: each rank trains on its slice of every batch, its
// gradients are reduced, the strategy steps the optimizer; then it saves in the single-process
// format, a fresh strategy resumes from one process's save, and both train on.
//
// Bit for bit where the sums are exact: one process; two ranks at any stage (a + b is b + a);
// ZeRO 3 at any world size and prefetch depth (its gradients are summed in rank order, as one
// process accumulates the ranks' micro-batches). ZeRO 0-2 over more ranks sum in Gloo's order: equal to float
// tolerance.
#include <algorithm>
#include <filesystem>
#include <optional>

#include "distributed_util.h"

namespace memfit {
namespace {

namespace fs = std::filesystem;

struct StrategyCase {
  const char* name;
  int world_size;
  int zero_stage;
  bool bit_exact;
  int prefetch_depth = 0;  // ZeRO 3: blocks gathered ahead (and gradients reduced in flight from 1)
  bool offload = false;    // the optimizer on the host (runtime/optimizer_offload.h)
};

std::ostream& operator<<(std::ostream& out, const StrategyCase& c) { return out << c.name; }

constexpr int kSteps = 4;          // trained, saved, then kSteps more after resuming
const OptimizerSpec& spec() {
  static const OptimizerSpec s = [] {
    OptimizerSpec o;  // AdamW: per-parameter state with two moments and a step
    o.lr = 0.05;
    return o;
  }();
  return s;
}

// Steps [first, last) of this rank: its slice of each batch, then the strategy's reduction and
// optimizer step.
void train_steps(Strategy& strategy, Chain& chain, torch::optim::Optimizer& optimizer, int first, int last) {
  for (int step = first; step < last; ++step) {
    const Batch batch = test::chain_batch(step);
    const BatchSlice mine = strategy.local_slice(batch.size());
    test::chain_micro_batch(chain, batch.slice(mine.start, mine.length), batch.size());
    if (OptimizerOffload* offload = strategy.optimizer_offload()) offload->release_device_gradients();
    strategy.reduce_gradients();
    strategy.optimizer_step(optimizer, StepOptions{});
  }
}

// The weights as one process holds them (every rank calls it; rank 0's file is read back).
std::vector<float> weights_of(Strategy& strategy, const fs::path& dump) {
  strategy.weights_sha256(dump.string());
  std::vector<float> values;
  if (!strategy.primary()) return values;
  values.resize(fs::file_size(dump) / sizeof(float));
  std::ifstream in(dump, std::ios::binary);
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  return values;
}

struct RankRun {
  std::string sha_before_save, sha_after_resume;
  std::vector<float> weights_after_resume;
};

nlohmann::json meta(int step) { return {{"step", step}}; }

StepConfig config_of(const StrategyCase& c) {
  StepConfig config;
  config.prefetch_depth = c.prefetch_depth;
  return config;
}

// One rank: kSteps steps, a save, then a fresh chain resumed from `resume_from` and kSteps more.
RankRun run_rank(const StrategyCase& c, int rank, const std::vector<std::string>& masters, const fs::path& dir,
                 const fs::path& resume_from) {
  DistributedOptions o;
  o.world_size = c.world_size;
  o.rank = rank;
  o.master = masters[0];
  o.zero_stage = c.zero_stage;
  RankRun out;
  auto chain = test::small_chain();
  {
    auto strategy = make_strategy(o, *chain);
    strategy->use_config(config_of(c));
    auto optimizer = make_optimizer(spec(), strategy->optimized_parameters());
    if (c.offload) {
      strategy->offload_optimizer(*optimizer);
      const auto& masters = strategy->optimizer_offload()->host_parameters();
      for (const auto& p : optimizer->param_groups().at(0).params()) {  // it steps host masters only
        EXPECT_TRUE(std::any_of(masters.begin(), masters.end(), [&](const at::Tensor& m) { return m.is_same(p); }));
      }
    }
    train_steps(*strategy, *chain, *optimizer, 0, kSteps);
    out.sha_before_save = strategy->weights_sha256("");
    std::optional<OptimizerOffload::DeviceKeys> keys;  // saved state names the model's parameters
    if (c.offload) keys.emplace(*strategy->optimizer_offload(), *optimizer);
    strategy->save({(dir / "saved").string(), *optimizer, spec(), meta(kSteps), c10::kCPU});
  }
  auto resumed_chain = test::small_chain();
  for (auto& p : resumed_chain->parameters()) p.detach().zero_();  // the saved state must bring them back
  o.master = masters[1];  // a new group: the first one's rendezvous has closed
  auto strategy = make_strategy(o, *resumed_chain);
  strategy->use_config(config_of(c));
  auto optimizer = make_optimizer(spec(), strategy->optimized_parameters());
  SavedState saved = SavedState::open(resume_from);
  strategy->resume(saved, *optimizer, spec(), c10::kCPU);
  if (c.offload) strategy->offload_optimizer(*optimizer);  // the resumed state moves to the host
  train_steps(*strategy, *resumed_chain, *optimizer, kSteps, 2 * kSteps);
  out.weights_after_resume = weights_of(*strategy, dir / ("weights-" + std::to_string(rank)));
  out.sha_after_resume = strategy->weights_sha256("");
  return out;
}

class StrategyTest : public ::testing::TestWithParam<StrategyCase> {
 protected:
  void SetUp() override {
    test::use_memfit_allocator();
    root_ = fs::temp_directory_path() / ("memfit-strategy-" + std::to_string(::getpid()) + "-" + GetParam().name);
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

// One process, with a plain loop and AdamW: kSteps, saved; then resumed and kSteps more.
struct Reference {
  std::string sha_before_save, sha_after_resume;
  std::vector<float> weights_after_resume;
};

Reference single_process(const fs::path& dir, int world) {
  Reference ref;
  auto chain = test::small_chain();
  auto optimizer = make_optimizer(spec(), chain->parameters());
  auto steps = [&](int first, int last) {
    for (int step = first; step < last; ++step) {
      const Batch batch = test::chain_batch(step);
      for (int r = 0; r < world; ++r) {  // the ranks' slices as micro-batches, in rank order
        const BatchSlice s = rank_slice(batch.size(), r, world);
        test::chain_micro_batch(*chain, batch.slice(s.start, s.length), batch.size());
      }
      optimizer->step();
      zero_grad(*optimizer, true);
    }
  };
  steps(0, kSteps);
  ref.sha_before_save = weights_sha256(*chain);
  save_state(dir, *chain, *optimizer, spec(), meta(kSteps), c10::kCPU);
  steps(kSteps, 2 * kSteps);
  ref.sha_after_resume = weights_sha256(*chain);
  for (const auto& p : chain->parameters()) {
    const at::Tensor c = p.detach().contiguous();
    ref.weights_after_resume.insert(ref.weights_after_resume.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return ref;
}

// Every tensor of two saved states, part by part.
void expect_same_saved_state(const fs::path& a_dir, const fs::path& b_dir, bool bit_exact) {
  const SavedState a = SavedState::open(a_dir), b = SavedState::open(b_dir);
  ASSERT_EQ(a.parts(), b.parts());
  for (int k = 0; k < a.parts(); ++k) {
    const StatePart x = a.read_part(k), y = b.read_part(k);
    ASSERT_EQ(x.parameter_names, y.parameter_names) << "part " << k;
    for (size_t i = 0; i < x.parameters.size(); ++i) {
      const auto same = [&](const at::Tensor& u, const at::Tensor& v) {
        if (!u.defined() || !v.defined()) return u.defined() == v.defined();  // an unused slot (AdamW's amsgrad)
        return bit_exact ? at::equal(u, v) : at::allclose(u, v, 1e-5, 1e-7);
      };
      EXPECT_TRUE(same(x.parameters[i], y.parameters[i])) << x.parameter_names[i];
      ASSERT_TRUE(x.parameter_state[i].has_value() && y.parameter_state[i].has_value()) << x.parameter_names[i];
      EXPECT_EQ(x.parameter_state[i]->step, y.parameter_state[i]->step);
      for (size_t s = 0; s < x.parameter_state[i]->tensors.size(); ++s) {
        EXPECT_TRUE(same(x.parameter_state[i]->tensors[s], y.parameter_state[i]->tensors[s]))
            << x.parameter_names[i] << " state slot " << s;
      }
    }
  }
}

TEST_P(StrategyTest, TrainsSavesAndResumesAsOneProcess) {
  const StrategyCase& c = GetParam();
  const Reference ref = single_process(root_ / "reference", c.world_size);
  const int first_port = test::free_port();
  int second_port = test::free_port();
  while (second_port == first_port) second_port = test::free_port();
  const std::vector<std::string> masters{"127.0.0.1:" + std::to_string(first_port), "127.0.0.1:" + std::to_string(second_port)};
  std::vector<RankRun> ranks(static_cast<size_t>(c.world_size));
  test::run_ranks(c.world_size, [&](int rank) {
    ranks[static_cast<size_t>(rank)] = run_rank(c, rank, masters, root_, root_ / "reference");
  });
  expect_same_saved_state(root_ / "reference", root_ / "saved", c.bit_exact);
  for (int r = 0; r < c.world_size; ++r) {
    const RankRun& run = ranks[static_cast<size_t>(r)];
    EXPECT_EQ(run.sha_before_save, ranks[0].sha_before_save) << "rank " << r << " holds other weights than rank 0";
    if (c.bit_exact) {
      EXPECT_EQ(run.sha_before_save, ref.sha_before_save) << "rank " << r << " before saving";
      EXPECT_EQ(run.sha_after_resume, ref.sha_after_resume) << "rank " << r << " after resuming one process's state";
    }
  }
  const std::vector<float>& got = ranks[0].weights_after_resume;
  ASSERT_EQ(got.size(), ref.weights_after_resume.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], ref.weights_after_resume[i], 1e-6 * (1 + std::abs(ref.weights_after_resume[i]))) << "weight " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, StrategyTest,
                         ::testing::Values(StrategyCase{"SingleProcess", 1, 0, true},
                                           StrategyCase{"ZeroReplicatedStage0TwoRanks", 2, 0, true},
                                           StrategyCase{"ZeroReplicatedStage1TwoRanks", 2, 1, true},
                                           StrategyCase{"ZeroReplicatedStage2TwoRanks", 2, 2, true},
                                           StrategyCase{"ZeroReplicatedStage2ThreeRanks", 3, 2, false},
                                           StrategyCase{"ZeroShardedTwoRanks", 2, 3, true},
                                           StrategyCase{"ZeroShardedFourRanks", 4, 3, true},
                                           StrategyCase{"ZeroShardedTwoRanksPrefetch1", 2, 3, true, 1},
                                           StrategyCase{"ZeroShardedFourRanksPrefetch2", 4, 3, true, 2},
                                           StrategyCase{"SingleProcessOffload", 1, 0, true, 0, true},
                                           StrategyCase{"ZeroReplicatedStage0TwoRanksOffload", 2, 0, true, 0, true},
                                           StrategyCase{"ZeroReplicatedStage1TwoRanksOffload", 2, 1, true, 0, true},
                                           StrategyCase{"ZeroReplicatedStage2TwoRanksOffload", 2, 2, true, 0, true}),
                         [](const ::testing::TestParamInfo<StrategyCase>& info) { return std::string(info.param.name); });

// The option the check refuses ("" where it accepts).
std::string refused_option(const StrategyAsk& ask) {
  try {
    check_strategy_options(ask);
  } catch (const OptionError& e) {
    return e.option();
  }
  return "";
}

TEST(StrategyRegistry, SelectsOneStrategyPerSetupAndEachRefusesWhatItCannotRun) {
  DistributedOptions o;
  EXPECT_STREQ(strategy_entry_for(o).name, "single process");
  o.world_size = 2;
  for (int stage : {0, 1, 2}) {
    o.zero_stage = stage;
    EXPECT_STREQ(strategy_entry_for(o).name, "ZeRO 0-2") << "stage " << stage;
  }
  o.zero_stage = 3;
  EXPECT_STREQ(strategy_entry_for(o).name, "ZeRO 3");

  StepConfig step;
  step.batch = 4;
  const int blocks = 4;
  // Offloading the optimizer: ZeRO 3 shards its state instead; stages 0-2 on the CPU take it.
  EXPECT_EQ(refused_option({o, step, false, false, {}, OffloadMode::kOptimizer, blocks}), "offload");
  o.zero_stage = 2;
  EXPECT_EQ(refused_option({o, step, false, false, {}, OffloadMode::kOptimizer, blocks}), "");
  // A pinned fp16: ZeRO 1 and 2 refuse it, one process and ZeRO 0 run it.
  step.precision = Precision::kFP16;
  EXPECT_EQ(refused_option({o, step, true, false, {}, OffloadMode::kNone, blocks}), "precision");
  EXPECT_EQ(refused_option({o, step, false, false, {}, OffloadMode::kNone, blocks}), "");  // planned, not pinned
  o.zero_stage = 0;
  EXPECT_EQ(refused_option({o, step, true, false, {}, OffloadMode::kNone, blocks}), "");
  o.world_size = 1;
  EXPECT_EQ(refused_option({o, step, true, false, {}, OffloadMode::kNone, blocks}), "");
  // ZeRO 3 saving 8-bit state, or pinned to recompute fewer than every block.
  o.world_size = 2;
  o.zero_stage = 3;
  step.precision = Precision::kFP32;
  step.optimizer.state = StatePrecision::k8Bit;
  EXPECT_EQ(refused_option({o, step, false, false, {true, false}, OffloadMode::kNone, blocks}), "optimizer.state");
  step.optimizer.state = StatePrecision::kFP32;
  step.checkpoint = CheckpointPlan::none();
  EXPECT_EQ(refused_option({o, step, false, true, {}, OffloadMode::kNone, blocks}), "checkpoint");
  step.checkpoint = CheckpointPlan::all(blocks);
  EXPECT_EQ(refused_option({o, step, false, true, {}, OffloadMode::kNone, blocks}), "");
  // The options themselves are checked first, whichever strategy they select.
  o.zero_stage = 4;
  EXPECT_EQ(refused_option({o, step, false, false, {}, OffloadMode::kNone, blocks}), "zero_stage");
}

}  // namespace
}  // namespace memfit
