// Activation checkpointing: bit-equal gradients, RNG and autocast preserved, and the bytes saved.
#include "test_util.h"

namespace memfit {
namespace {

using test::grads_of;

// Gradients of one forward/backward of the small GPT under `plan`, from the same seeds.
std::vector<at::Tensor> gpt_gradients(const CheckpointPlan& plan, Precision precision) {
  Workload w = make_workload(test::small_gpt(/*seed=*/7));
  Batch batch = w.data->train_batch(0, 4, /*seed=*/7);
  torch::manual_seed(123);  // the same dropout stream for both runs
  at::Tensor loss;
  {
    Autocast autocast(c10::kCPU, precision);
    loss = w.loss(w.chain->forward(batch.input, plan), batch.target);
  }
  loss.backward();
  return grads_of(*w.chain);
}

void expect_bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].defined()) << "parameter " << i << " got no gradient";
    ASSERT_TRUE(b[i].defined()) << "parameter " << i << " got no gradient";
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i << " differs by "
                                          << (a[i] - b[i]).abs().max().item<double>();
  }
}

TEST(CheckpointTest, GradientsBitEqualWithDropoutFp32) {
  test::use_memfit_allocator();
  const int blocks = 14;
  auto plain = gpt_gradients(CheckpointPlan::none(), Precision::kFP32);
  expect_bit_equal(plain, gpt_gradients(CheckpointPlan::all(blocks), Precision::kFP32));
  expect_bit_equal(plain, gpt_gradients(CheckpointPlan::every(3, blocks), Precision::kFP32));
  expect_bit_equal(plain, gpt_gradients(CheckpointPlan::of_blocks({1, 4, 13}, blocks), Precision::kFP32));
}

TEST(CheckpointTest, GradientsBitEqualWithDropoutBf16Autocast) {
  test::use_memfit_allocator();
  auto plain = gpt_gradients(CheckpointPlan::none(), Precision::kBF16);
  expect_bit_equal(plain, gpt_gradients(CheckpointPlan::all(14), Precision::kBF16));
}

TEST(CheckpointTest, RecomputeWithoutRngRestoreWouldDiffer) {
  // Guards the test above against passing trivially: a different dropout stream changes gradients.
  test::use_memfit_allocator();
  auto a = gpt_gradients(CheckpointPlan::none(), Precision::kFP32);
  Workload w = make_workload(test::small_gpt(7));
  Batch batch = w.data->train_batch(0, 4, 7);
  torch::manual_seed(999);
  w.loss(w.chain->forward(batch.input), batch.target).backward();
  auto b = grads_of(*w.chain);
  EXPECT_FALSE(torch::equal(a[1], b[1]));
}

TEST(CheckpointTest, ParametersGetGradientsWhenInputDoesNotRequireGrad) {
  test::use_memfit_allocator();
  torch::manual_seed(0);
  auto linear = torch::nn::Linear(8, 8);
  auto x = torch::randn({4, 8});  // requires_grad = false
  auto y = checkpoint([&](const at::Tensor& in) { return torch::tanh(linear(in)); }, x, linear->parameters());
  y.sum().backward();
  ASSERT_TRUE(linear->weight.grad().defined());
  auto expected = linear->weight.grad().clone();
  linear->zero_grad();
  torch::tanh(linear(x)).sum().backward();
  EXPECT_TRUE(torch::equal(expected, linear->weight.grad()));
}

TEST(CheckpointTest, InputGradientAndNesting) {
  test::use_memfit_allocator();
  torch::manual_seed(0);
  auto a = torch::nn::Linear(8, 8), b = torch::nn::Linear(8, 8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto inner = [&](const at::Tensor& in) { return torch::gelu(b(in)); };
  auto outer = [&](const at::Tensor& in) { return checkpoint(inner, torch::gelu(a(in)), b->parameters()); };
  std::vector<at::Tensor> params = a->parameters();
  for (auto& p : b->parameters()) params.push_back(p);
  checkpoint(outer, x, params).sum().backward();
  auto gx = x.grad().clone(), ga = a->weight.grad().clone(), gb = b->weight.grad().clone();
  x.mutable_grad().reset();
  a->zero_grad();
  b->zero_grad();
  torch::gelu(b(torch::gelu(a(x)))).sum().backward();
  EXPECT_TRUE(torch::equal(gx, x.grad()));
  EXPECT_TRUE(torch::equal(ga, a->weight.grad()));
  EXPECT_TRUE(torch::equal(gb, b->weight.grad()));
}

// Where it is not known whether the block writes into its input, the first pass runs on the
// caller's tensor itself, as a plain run does (MKL may round differently on a copy, which sits
// elsewhere in memory), and both kinds of block get the plain run's gradients.
TEST(CheckpointTest, BlockOfUnknownWritesRunsOnTheCallersTensor) {
  test::use_memfit_allocator();
  torch::manual_seed(0);
  auto linear = torch::nn::Linear(8, 8);
  const at::Tensor batch = torch::randn({6, 8});
  for (const bool writes : {false, true}) {
    std::vector<const void*> seen;  // where the block's input lay, in the forward and the recompute
    const auto block = [&](const at::Tensor& in) {
      seen.push_back(in.data_ptr());
      return torch::tanh(linear(writes ? in.mul_(2.0) : in));
    };
    const at::Tensor x = batch.slice(0, 1, 5).clone().requires_grad_(true);  // a leaf: its gradient is checked
    const at::Tensor input = x * 1.0;  // not a leaf: a leaf requiring grad may not be written into
    checkpoint(block, input, linear->parameters(), {}, InputWrites::kUnknown).sum().backward();
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen[0], input.data_ptr()) << "writes " << writes;
    EXPECT_EQ(seen[1] == input.data_ptr(), !writes) << "the recompute copies only for a block that writes";
    const at::Tensor gx = x.grad().clone(), gw = linear->weight.grad().clone();
    x.mutable_grad().reset();
    linear->zero_grad();
    torch::tanh(linear(writes ? (x * 1.0).mul_(2.0) : x * 1.0)).sum().backward();
    EXPECT_TRUE(torch::equal(gx, x.grad())) << "writes " << writes;
    EXPECT_TRUE(torch::equal(gw, linear->weight.grad())) << "writes " << writes;
    linear->zero_grad();
  }
}

// What a segment saves (its input, the random state its forward drew from) is autograd's saved
// variables: freed once its backward has run, though the graph lives on with the loss (the
// planner counts it so); kept where the graph is retained, so a second backward recomputes
// with the same dropout masks.
TEST(CheckpointTest, WhatASegmentSavesIsFreedByItsBackwardUnlessTheGraphIsRetained) {
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  torch::manual_seed(0);
  auto linear = torch::nn::Linear(8, 8);
  const auto block = [&](const at::Tensor& in) { return torch::dropout(linear(in), 0.5, true); };
  const at::Tensor x = torch::randn({4, 8});
  checkpoint(block, x, linear->parameters()).sum().backward();  // the gradients made: later runs add into them
  const int64_t before = tracker->current(test::cpu_counted());
  at::Tensor loss = checkpoint(block, x, linear->parameters()).sum();
  const auto random_state = static_cast<int64_t>(capture_rng(x.device()).cpu.nbytes());
  EXPECT_EQ(tracker->current(test::cpu_counted()) - before, static_cast<int64_t>(loss.nbytes()) + random_state);
  loss.backward();
  EXPECT_EQ(tracker->current(test::cpu_counted()) - before, static_cast<int64_t>(loss.nbytes())) << "the loss alone, its graph emptied";

  linear->zero_grad();
  loss = checkpoint(block, x, linear->parameters()).sum();
  loss.backward({}, /*retain_graph=*/true);
  const at::Tensor once = linear->weight.grad().clone();
  loss.backward();
  EXPECT_TRUE(torch::equal(linear->weight.grad(), once + once)) << "the second recompute drew other masks";
}

TEST(CheckpointTest, RestoresTheCallersRandomStream) {
  test::use_memfit_allocator();
  torch::manual_seed(5);
  auto x = torch::randn({16, 16}, torch::requires_grad());
  auto y = checkpoint([](const at::Tensor& in) { return torch::dropout(in, 0.5, true); }, x, {});
  auto next_after_forward = torch::rand({1}).item<float>();
  torch::manual_seed(5);
  auto x2 = torch::randn({16, 16});
  torch::dropout(x2, 0.5, true);
  EXPECT_EQ(next_after_forward, torch::rand({1}).item<float>());
  y.sum().backward();  // the recompute must not disturb the stream either
  auto r1 = torch::rand({1}).item<float>();
  torch::manual_seed(5);
  torch::randn({16, 16});
  torch::dropout(x2, 0.5, true);
  torch::rand({1});
  EXPECT_EQ(r1, torch::rand({1}).item<float>());
}

TEST(CheckpointTest, ParsesPlans) {
  EXPECT_EQ(CheckpointPlan::parse("none", 10).recomputed_blocks().size(), 0u);
  EXPECT_EQ(CheckpointPlan::parse("all", 10).segments.size(), 10u);
  auto every = CheckpointPlan::parse("every:4", 10);
  ASSERT_EQ(every.segments.size(), 3u);
  EXPECT_EQ(every.segments[2], std::make_pair(8, 9));
  EXPECT_EQ(CheckpointPlan::parse("3,1", 10).describe(), "1,3");
  for (const char* bad : {"every:0", "every:x", "1,,2", "12", "-1", "some"}) {
    EXPECT_THROW(CheckpointPlan::parse(bad, 10), std::invalid_argument) << bad;
  }
}

// BatchNorm's running statistics count each batch once, recomputed or not (PyTorch's
// checkpoint updates them a second time in the recompute); gradients stay bit-equal.
TEST(CheckpointTest, RecomputeDoesNotUpdateBuffersTwice) {
  auto run = [](const CheckpointPlan& plan) {
    torch::manual_seed(5);
    auto chain = std::make_shared<Chain>();
    chain->add("a", torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU()).ptr());
    chain->add("b", torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::BatchNorm1d(16)).ptr());
    chain->forward(torch::randn({32, 8}), plan).pow(2).mean().backward();
    std::vector<at::Tensor> state;
    for (const auto& b : chain->buffers()) state.push_back(b.clone());
    for (const auto& g : test::grads_of(*chain)) state.push_back(g);
    return state;
  };
  const auto plain = run(CheckpointPlan::none());
  const auto recomputed = run(CheckpointPlan::all(2));
  ASSERT_EQ(plain.size(), recomputed.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(plain[i].equal(recomputed[i])) << "buffer or gradient " << i;
}

}  // namespace
}  // namespace memfit
