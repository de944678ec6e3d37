// Offload: the host space counted apart from the budgeted device, the optimizer stepping on the
// host bit-equal to the device's and given back to it, and a plan below the device-only floor that trains.
#include "test_util.h"

#include <unistd.h>

#include <filesystem>
#include <numeric>

namespace memfit {
namespace {

TEST(MemorySpaceTest, HostBytesAreCountedApartAndNeverRefused) {
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  BudgetAllocator& alloc = BudgetAllocator::install();
  const int64_t device_before = alloc.allocated(), host_before = alloc.host_allocated();
  at::Tensor host;
  {
    BudgetGuard budget(device_before + (1 << 20));  // 1 MiB more on the device
    {
      HostSpaceGuard on_host;
      host = torch::zeros({1 << 20});  // 4 MiB: over the device's budget, none of it counted there
    }
    EXPECT_THROW(torch::zeros({1 << 20}), c10::OutOfMemoryError);  // the same on the device is refused
  }
  EXPECT_EQ(alloc.host_allocated() - host_before, 4 << 20);
  EXPECT_EQ(alloc.allocated(), device_before);
  EXPECT_EQ(tracker->current(MemoryDevice::kHost), 4 << 20);
  EXPECT_EQ(tracker->current(test::cpu_counted()), 0);
  const at::Tensor back = copy_to_device(host, c10::kCPU);  // a copy back is device bytes
  EXPECT_EQ(tracker->current(test::cpu_counted()), 4 << 20);
  EXPECT_TRUE(back.equal(host));
  host.reset();
  EXPECT_EQ(tracker->current(MemoryDevice::kHost), 0);
  EXPECT_EQ(alloc.host_allocated(), host_before);
}

// Tensors made before a tracker, adopted by it: each counted in the space it was allocated in
// (memfit.track adopts an offloaded optimizer's masters and state so).
TEST(MemorySpaceTest, AdoptedHostTensorsCountAsTheHosts) {
  test::use_memfit_allocator();
  const at::Tensor on_device = torch::zeros({1024});
  at::Tensor on_host;
  {
    HostSpaceGuard host;
    on_host = torch::zeros({2048});
  }
  MemoryTracker tracker;
  adopt_tensors(tracker, {on_device, on_host});
  EXPECT_EQ(tracker.current(test::cpu_counted()), 4096);
  EXPECT_EQ(tracker.current(MemoryDevice::kHost), 8192);
}

// The small GPT with a tracker installed on this thread, counting its weights and buffers.
struct TrackedGpt {
  explicit TrackedGpt(uint64_t seed)
      : w((test::use_memfit_allocator(), make_workload(test::small_gpt(seed)))),
        tracker(std::make_shared<MemoryTracker>()),
        scope(tracker) {
    adopt_tensors(*tracker, w.chain->parameters());
    adopt_tensors(*tracker, w.chain->buffers());
  }
  Workload w;
  std::shared_ptr<MemoryTracker> tracker;
  TrackerScope scope;
};

// Two steps of 2 micro-batches each, with or without the optimizer offloaded; the weights after
// each, and what the tracker counted on the device and the host during the second.
struct OffloadRun {
  std::vector<std::vector<at::Tensor>> weights;
  int64_t device_live_after = 0, host_live_after = 0, host_peak = 0;
};

OffloadRun run_steps(bool offloaded) {
  TrackedGpt gpt(3);
  Workload& w = gpt.w;
  MemoryTracker* tracker = gpt.tracker.get();
  OptimizerSpec spec;  // AdamW
  StepConfig c;
  c.batch = 8;
  c.micro_batch = 4;
  c.checkpoint = CheckpointPlan::parse("every:2", w.chain->size());
  std::unique_ptr<OptimizerOffload> offload;
  auto optimizer = make_optimizer(spec, w.chain->parameters());
  StepOptions so{c};
  if (offloaded) {
    offload = std::make_unique<OptimizerOffload>(w.chain->parameters());
    offload->adopt(*optimizer);
    offload->attach(so);
  }
  OffloadRun r;
  torch::manual_seed(1);
  for (int64_t i = 0; i < 2; ++i) {
    const Batch batch = w.data->train_batch(i, c.batch, w.seed);
    tracker->reset_peak();
    accumulate_gradients(w, batch, split_batch(c.batch, 4), so);
    const auto step = [&] { optimizer_step(*optimizer, so); };
    offload ? offload->step(step) : step();
    std::vector<at::Tensor> weights;
    for (const auto& p : w.chain->parameters()) weights.push_back(p.detach().clone());
    r.weights.push_back(std::move(weights));
  }
  r.device_live_after = tracker->current(test::cpu_counted());
  r.host_live_after = tracker->current(MemoryDevice::kHost);
  r.host_peak = tracker->peak(MemoryDevice::kHost);
  return r;
}

TEST(OptimizerOffloadTest, StepsOnTheHostBitEqualToTheDevice) {
  const OffloadRun plain = run_steps(false), offloaded = run_steps(true);
  for (size_t s = 0; s < plain.weights.size(); ++s) {
    for (size_t i = 0; i < plain.weights[s].size(); ++i) {
      EXPECT_TRUE(plain.weights[s][i].equal(offloaded.weights[s][i])) << "step " << s + 1 << ", parameter " << i;
    }
  }
  Workload w = make_workload(test::small_gpt(3));
  const int64_t weights = parameter_bytes(*w.chain);
  // Between steps the device holds what it held without the optimizer: its state moved out.
  EXPECT_EQ(plain.device_live_after - offloaded.device_live_after, 2 * weights);  // AdamW's two moments
  EXPECT_EQ(offloaded.host_live_after, weights + 2 * weights);  // fp32 masters and the state
  EXPECT_GE(offloaded.host_peak, weights + weights + 2 * weights);  // and every gradient, summed there
}

// release(), the reverse of adopt(): the optimizer steps the device parameters again, its state
// keyed by them and back in the device's bytes; with the offload gone (its hooks), a step on the
// device is the step it would have been without the offload.
TEST(OptimizerOffloadTest, ReleaseGivesTheOptimizerBackOnTheDevice) {
  test::use_memfit_allocator();
  torch::manual_seed(2);
  torch::nn::Linear a(64, 32), b(64, 32);
  for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].detach().copy_(a->parameters()[i].detach());
  torch::optim::AdamW mine(a->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW reference(b->parameters(), torch::optim::AdamWOptions(1e-2));
  const at::Tensor x = at::randn({16, 64});
  const auto step = [&](torch::nn::Linear& net, torch::optim::Optimizer& optimizer) {
    optimizer.zero_grad();
    net->forward(x).square().mean().backward();
    optimizer.step();
  };
  step(a, mine);
  step(b, reference);
  BudgetAllocator& alloc = BudgetAllocator::install();
  const int64_t device_before = alloc.allocated(), host_before = alloc.host_allocated();
  {
    OptimizerOffload offload(a->parameters());
    offload.adopt(mine);
    EXPECT_EQ(device_before - alloc.allocated(), 2 * parameter_bytes(*a)) << "AdamW's two moments left the device";
    offload.release(mine);
    EXPECT_EQ(alloc.allocated(), device_before) << "and are back";
    EXPECT_EQ(alloc.host_allocated() - host_before, parameter_bytes(*a)) << "the masters, until the offload goes";
    ASSERT_EQ(mine.param_groups()[0].params().size(), a->parameters().size());
    const auto adam_state = [](torch::optim::Optimizer& o, const at::Tensor& p) -> const torch::optim::AdamWParamState& {
      return static_cast<const torch::optim::AdamWParamState&>(*o.state().at(param_state_key(p)));
    };
    for (size_t i = 0; i < a->parameters().size(); ++i) {
      EXPECT_TRUE(mine.param_groups()[0].params()[i].is_same(a->parameters()[i]));
      const auto& s = adam_state(mine, a->parameters()[i]);
      const auto& r = adam_state(reference, b->parameters()[i]);
      EXPECT_EQ(s.step(), r.step());
      EXPECT_TRUE(s.exp_avg().equal(r.exp_avg()) && s.exp_avg_sq().equal(r.exp_avg_sq()));
    }
  }
  EXPECT_EQ(alloc.host_allocated(), host_before);
  step(a, mine);
  step(b, reference);
  for (size_t i = 0; i < a->parameters().size(); ++i) EXPECT_TRUE(a->parameters()[i].equal(b->parameters()[i])) << i;
}

// One forward + backward of the small GPT with the given blocks' activations offloaded: the
// gradients, and the device and host peaks the tracker saw.
struct ActivationRun {
  std::vector<at::Tensor> grads;
  int64_t device_peak = 0, host_peak = 0, host_after = 0;
};

ActivationRun run_with_offloaded(const std::vector<int>& blocks) {
  TrackedGpt gpt(8);
  Workload& w = gpt.w;
  MemoryTracker* tracker = gpt.tracker.get();
  StepConfig c;
  c.batch = 8;
  c.offload.activation_blocks = blocks;
  const Batch batch = w.data->train_batch(0, c.batch, w.seed);
  torch::manual_seed(2);  // the same dropout draws in every run
  tracker->reset_peak();
  forward_backward(w, batch, 1.0, StepOptions{c});
  ActivationRun r;
  r.grads = test::grads_of(*w.chain);
  r.device_peak = tracker->peak(test::cpu_counted());
  r.host_peak = tracker->peak(MemoryDevice::kHost);
  r.host_after = tracker->current(MemoryDevice::kHost);
  return r;
}

TEST(ActivationOffloadTest, GradientsBitEqualWithLessOnTheDevice) {
  ASSERT_TRUE(activation_offload_available());
  const ActivationRun plain = run_with_offloaded({});
  std::vector<int> all(static_cast<size_t>(make_workload(test::small_gpt(8)).chain->size()));
  std::iota(all.begin(), all.end(), 0);
  const ActivationRun offloaded = run_with_offloaded(all);
  ASSERT_EQ(plain.grads.size(), offloaded.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i) EXPECT_TRUE(plain.grads[i].equal(offloaded.grads[i])) << "parameter " << i;
  EXPECT_EQ(plain.host_peak, 0);
  EXPECT_GT(offloaded.host_peak, 0);
  EXPECT_EQ(offloaded.host_after, 0) << "every activation came back and went";
  EXPECT_LT(offloaded.device_peak, plain.device_peak);
}

// Prefetch one block ahead: when backward reaches the block after an offloaded one, the
// offloaded block's saved storage is already back on the device (made there, its copy under
// way), before backward reaches the offloaded block itself; without prefetch it is not yet.
int64_t device_bytes_when_next_block_is_reached(bool prefetch) {
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  const at::Tensor x = torch::randn({1 << 16}).requires_grad_(true);  // 256 KiB
  std::shared_ptr<OffloadedActivations> saved;
  // sin saves its input, made in the block: x * 2 (256 KiB) goes to the host.
  const at::Tensor a = run_offloaded([](const at::Tensor& in) { return (in * 2).sin(); }, x, {}, &saved);
  const at::Tensor b = a.exp();  // the block after it (plain)
  if (prefetch) prefetch_when_reached(b, saved);
  int64_t device_then = -1;
  b.register_hook([&](const at::Tensor&) { device_then = tracker->current(test::cpu_counted()); });
  const int64_t before_backward = tracker->current(test::cpu_counted());
  b.sum().backward();
  return device_then - before_backward;
}

TEST(ActivationOffloadTest, PrefetchBringsTheBlockBackWhenTheNextIsReached) {
  ASSERT_TRUE(activation_offload_available());
  const int64_t with = device_bytes_when_next_block_is_reached(true);
  const int64_t without = device_bytes_when_next_block_is_reached(false);
  EXPECT_EQ(with - without, (1 << 16) * 4) << "the offloaded block's saved x * 2, back on the device";
}

TrainOptions offload_options() {
  TrainOptions o;
  o.step.batch = 8;
  o.steps = 6;
  o.step.precision = Precision::kFP32;
  o.pin_precision = true;
  o.eval_every = 0;
  o.report_html.clear();
  return o;
}

// The device-only floor (weights + gradients + state + the least activations) of the workload.
int64_t device_floor(const TrainOptions& options) {
  Workload w = make_workload(test::small_gpt(5));
  TrainOptions o = options;
  o.budget_bytes = 1LL << 32;
  Trainer t(w, o);
  t.set_up();
  return t.plan().floor_bytes;
}

TEST(OffloadTrainTest, OptimizerOffloadTrainsBelowTheDeviceFloorAsTheDeviceWould) {
  test::use_memfit_allocator();
  TrainObserver quiet;
  TrainOptions o = offload_options();
  const int64_t floor = device_floor(o);
  o.budget_bytes = floor * 6 / 10;
  o.offload = OffloadMode::kAuto;
  Workload w = make_workload(test::small_gpt(5));
  const TrainSummary off = train(w, o, quiet);
  ASSERT_TRUE(off.plan.config.offload.optimizer) << off.plan.config.describe();
  EXPECT_LE(off.peak_bytes, off.budget_bytes);
  EXPECT_LT(off.plan.floor_bytes, floor) << "offload lowers the floor";
  const auto within = [](int64_t predicted, int64_t measured) {
    return std::abs(static_cast<double>(predicted - measured)) <= 0.03 * static_cast<double>(measured);
  };
  EXPECT_TRUE(within(off.plan.predicted_peak, off.peak_bytes))
      << "device: predicted " << off.plan.predicted_peak << ", measured " << off.peak_bytes;
  EXPECT_TRUE(within(off.plan.predicted_host_peak, off.host_peak_bytes))
      << "host: predicted " << off.plan.predicted_host_peak << ", measured " << off.host_peak_bytes;

  // The same configuration with the optimizer on the device: the same losses, bit for bit.
  TrainOptions same = offload_options();
  same.budget_bytes = 1LL << 32;
  same.step.micro_batch = off.plan.config.micro_batch_size();
  same.step.checkpoint = off.plan.config.checkpoint;
  same.pin_checkpoint = true;
  Workload w2 = make_workload(test::small_gpt(5));
  const TrainSummary on_device = train(w2, same, quiet);
  EXPECT_FALSE(on_device.plan.config.offload.any());
  EXPECT_EQ(off.losses, on_device.losses);
  EXPECT_EQ(off.weights_sha256, on_device.weights_sha256);
  EXPECT_LT(off.losses.back(), off.losses.front());
}

// Half the plain step's peak, the whole batch in one micro-batch, nothing recomputed: the plan
// offloads activations, its peaks hold within 3%, and the losses are those of the plain step.
// A share of the plain step's peak with nothing recomputed: offloading alone must make it fit,
// the device and host peaks as predicted, the losses those of the plain run.
void expect_activation_offload_fits(Precision precision, double share) {
  test::use_memfit_allocator();
  TrainObserver quiet;
  TrainOptions plain = offload_options();
  plain.step.precision = precision;
  plain.budget_bytes = 1LL << 32;
  plain.step.micro_batch = 8;
  plain.pin_checkpoint = true;  // none
  Workload w = make_workload(test::small_gpt(9));
  const TrainSummary reference = train(w, plain, quiet);

  TrainOptions o = plain;
  o.offload = OffloadMode::kActivations;  // (not timings: nothing recomputed, the same micro-batch)
  o.budget_bytes = static_cast<int64_t>(static_cast<double>(reference.plan.plain_predicted_peak) * share);
  Workload w2 = make_workload(test::small_gpt(9));
  const TrainSummary off = train(w2, o, quiet);
  ASSERT_FALSE(off.plan.config.offload.activation_blocks.empty()) << off.plan.config.describe();
  EXPECT_FALSE(off.plan.config.offload.optimizer);
  EXPECT_LE(off.peak_bytes, off.budget_bytes);
  const auto error = [](int64_t predicted, int64_t measured) {
    return std::abs(static_cast<double>(predicted - measured)) / static_cast<double>(measured);
  };
  EXPECT_LE(error(off.plan.predicted_peak, off.peak_bytes), 0.03)
      << "predicted " << off.plan.predicted_peak << ", measured " << off.peak_bytes;
  EXPECT_LE(error(off.plan.predicted_host_peak, off.host_peak_bytes), 0.03)
      << "predicted " << off.plan.predicted_host_peak << ", measured " << off.host_peak_bytes;
  EXPECT_EQ(off.losses, reference.losses);  // offloading changes no number
  EXPECT_LT(off.losses.back(), off.losses.front());
}

TEST(OffloadTrainTest, ActivationOffloadHalvesThePeakAsPredicted) { expect_activation_offload_fits(Precision::kFP32, 0.5); }

// Under autocast the blocks' graphs keep weight copies cast before forward: they stay on the
// device, the rest moves. (This small GPT's bf16 step is mostly weights and their copies: 0.6.)
TEST(OffloadTrainTest, ActivationOffloadUnderAutocastFitsAsPredicted) {
  expect_activation_offload_fits(Precision::kBF16, 0.6);
}

// Saved mid-run with the optimizer on the host, resumed: the same losses and weights as a run
// straight through (the saved state names the model's parameters, as without offload).
TEST(OffloadTrainTest, ResumeIsExact) {
  test::use_memfit_allocator();
  const auto dir = std::filesystem::temp_directory_path() / ("memfit-offload-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  TrainObserver quiet;
  TrainOptions o = offload_options();
  o.budget_bytes = 1LL << 32;
  o.offload = OffloadMode::kOptimizer;
  o.step.micro_batch = 4;
  o.pin_checkpoint = true;  // a plan chosen by timings could differ between the runs
  Workload straight_w = make_workload(test::small_gpt(6));
  const TrainSummary straight = train(straight_w, o, quiet);
  ASSERT_TRUE(straight.plan.config.offload.optimizer);

  TrainOptions first_half = o;
  first_half.steps = 3;
  first_half.save_dir = dir.string();
  Workload first_w = make_workload(test::small_gpt(6));
  train(first_w, first_half, quiet);
  TrainOptions second_half = o;
  second_half.resume_dir = dir.string();
  Workload resumed_w = make_workload(test::small_gpt(6));
  const TrainSummary resumed = train(resumed_w, second_half, quiet);
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[3 + i]) << "step " << 4 + i;
  EXPECT_EQ(resumed.weights_sha256, straight.weights_sha256);
  std::filesystem::remove_all(dir);
}

TEST(OffloadTrainTest, OffloadIsRefusedWhereItIsNotBuilt) {
  test::use_memfit_allocator();
  Workload w = make_workload(test::small_gpt(7));
  TrainOptions o = offload_options();
  o.offload = OffloadMode::kOptimizer;
  o.distributed.world_size = 2;
  o.distributed.master = "127.0.0.1:1";
  EXPECT_NO_THROW(check_train_options(o, w));  // ZeRO 0-2: the reductions run on the host's gradients
  o.distributed.zero_stage = 3;
  EXPECT_THROW(check_train_options(o, w), OptionError);
  EXPECT_THROW(parse_offload_mode("cpu"), OptionError);
  // A host budget below what the optimizer's state needs there: said, naming that amount.
  TrainOptions tight = offload_options();
  tight.offload = OffloadMode::kOptimizer;
  tight.budget_bytes = 1LL << 32;
  tight.host_budget_bytes = 1000;
  TrainObserver quiet;
  try {
    train(w, tight, quiet);
    ADD_FAILURE() << "a 1000-byte host budget was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("host budget"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memfit
