// Each technique of the lesson, proven in bytes counted by the tracker (via run_report) or
// in gradients compared with a reference.
#include "test_util.h"

namespace memfit {
namespace {

Report report_of(const ReportOptions& o) { return test::report_of(test::small_gpt(), o); }

ReportOptions gpt_options(int64_t batch = 8) { return test::report_options(batch); }

TEST(TechniquesTest, CheckpointingEveryBlockCutsActivationsAtPeak) {
  auto plain = report_of(gpt_options());
  auto o = gpt_options();
  o.step.checkpoint = CheckpointPlan::all(14);
  auto ckpt = report_of(o);
  const double ratio = static_cast<double>(ckpt.analysis.at_peak.activations) /
                       static_cast<double>(plain.analysis.at_peak.activations);
  RecordProperty("activation_ratio", std::to_string(ratio));
  EXPECT_LE(ratio, 0.4) << "plain " << plain.analysis.at_peak.activations << " checkpointed "
                        << ckpt.analysis.at_peak.activations;
  EXPECT_LT(ckpt.analysis.peak_bytes, plain.analysis.peak_bytes);
}

TEST(TechniquesTest, MicroBatchingMatchesFullBatchGradients) {
  test::use_memfit_allocator();
  ModelOptions m = test::small_gpt(3);
  m.gpt.dropout = 0;  // dropout draws differ by micro-batch shape; compare the math alone
  Workload w = make_workload(m);
  Batch batch = w.data->train_batch(0, 8, 3);
  StepOptions full;
  forward_backward(w, batch, 1.0, full);
  auto reference = test::grads_of(*w.chain);
  zero_grad(w.chain->parameters());
  for (const auto& mb : split_batch(8, 2)) forward_backward(w, batch.slice(mb.start, mb.length), mb.weight, full);
  auto accumulated = test::grads_of(*w.chain);
  EXPECT_LE(test::max_relative_difference(reference, accumulated), 1e-5);
  // The last micro-batch may be smaller: 8 = 3 + 3 + 2.
  zero_grad(w.chain->parameters());
  for (const auto& mb : split_batch(8, 3)) forward_backward(w, batch.slice(mb.start, mb.length), mb.weight, full);
  EXPECT_LE(test::max_relative_difference(reference, test::grads_of(*w.chain)), 1e-5);
}

TEST(TechniquesTest, MicroBatchQuarterCutsActivationsAtPeak) {
  auto plain = report_of(gpt_options(8));
  auto o = gpt_options(8);
  o.step.micro_batch = 2;
  auto micro = report_of(o);
  const double ratio = static_cast<double>(micro.analysis.at_peak.activations) /
                       static_cast<double>(plain.analysis.at_peak.activations);
  EXPECT_LE(ratio, 0.35) << "plain " << plain.analysis.at_peak.activations << " micro "
                         << micro.analysis.at_peak.activations;
}

TEST(TechniquesTest, SplitBatchRejectsBadSizes) {
  EXPECT_THROW(split_batch(8, 9), std::invalid_argument);
  EXPECT_THROW(split_batch(8, 0), std::invalid_argument);
  auto parts = split_in_two({4, 5, 5.0 / 16}, 16);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].length + parts[1].length, 5);
  EXPECT_DOUBLE_EQ(parts[0].weight + parts[1].weight, 5.0 / 16);
}

TEST(TechniquesTest, Bf16AutocastCutsActivationsAndReportsTheCastCache) {
  auto fp32 = report_of(gpt_options());
  auto o = gpt_options();
  o.step.precision = Precision::kBF16;
  auto bf16 = report_of(o);
  const double ratio = static_cast<double>(bf16.analysis.at_peak.activations) /
                       static_cast<double>(fp32.analysis.at_peak.activations);
  EXPECT_LE(ratio, 0.7) << "fp32 " << fp32.analysis.at_peak.activations << " bf16 "
                        << bf16.analysis.at_peak.activations;
  // The cast cache exists during forward and is freed when autocast exits; the timeline sees it.
  int64_t max_cache = 0;
  for (const auto& p : bf16.analysis.timeline) max_cache = std::max(max_cache, p.live.autocast_cache);
  EXPECT_GT(max_cache, 0);
  // bf16 copies of the Linear weights: at most half the fp32 parameter bytes.
  EXPECT_LE(2 * max_cache, bf16.parameter_bytes);
  EXPECT_GT(bf16.analysis.at_peak.autocast_cache, 0);  // saved for backward, so alive at the peak
  EXPECT_EQ(bf16.analysis.at_end.autocast_cache, 0);
}

TEST(TechniquesTest, SetToNoneReleasesExactlyTheGradientBytes) {
  auto released = report_of(gpt_options());
  auto o = gpt_options();
  o.step.set_to_none = false;
  auto kept = report_of(o);
  EXPECT_EQ(kept.between_steps_bytes - released.between_steps_bytes, released.parameter_bytes);
}

TEST(TechniquesTest, EvalPeakIsSmall) {
  auto train = report_of(gpt_options());
  auto o = gpt_options();
  o.eval_only = true;
  auto eval = report_of(o);
  EXPECT_LE(static_cast<double>(eval.analysis.peak_bytes), 0.35 * static_cast<double>(train.analysis.peak_bytes));
}

TEST(TechniquesTest, EvaluateRunsUnderInferenceMode) {
  test::use_memfit_allocator();
  auto w = torch::randn({4, 4}, torch::requires_grad());
  auto y = evaluate([&] { return w.matmul(w); });
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(y.is_inference());
}

// --- GradScaler ---

struct TinyModel {
  torch::nn::Linear linear{4, 2};
  torch::optim::AdamW optimizer{linear->parameters(), torch::optim::AdamWOptions(0.1)};
  void backward(GradScaler& scaler) {
    auto x = torch::ones({3, 4});
    scaler.scale(linear(x).pow(2).mean()).backward();
  }
};

TEST(GradScalerTest, InfSkipsStepAndBacksOff) {
  test::use_memfit_allocator();
  torch::manual_seed(0);
  TinyModel m;
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  // One clean step creates the optimizer state.
  m.backward(scaler);
  EXPECT_FALSE(scaler.step(m.optimizer).skipped);
  scaler.update();
  zero_grad(m.optimizer);
  auto weight_before = m.linear->weight.detach().clone();
  auto& state = static_cast<torch::optim::AdamWParamState&>(
      *m.optimizer.state().at(param_state_key(m.linear->weight)));
  auto exp_avg_before = state.exp_avg().clone();

  m.backward(scaler);
  {
    torch::NoGradGuard no_grad;
    m.linear->weight.mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
  }
  auto outcome = scaler.step(m.optimizer);
  EXPECT_TRUE(outcome.skipped);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);
  EXPECT_TRUE(torch::equal(weight_before, m.linear->weight));
  EXPECT_TRUE(torch::equal(exp_avg_before, state.exp_avg()));
  EXPECT_TRUE(torch::isfinite(m.linear->weight).all().item<bool>());
}

TEST(GradScalerTest, GrowsAfterIntervalCleanSteps) {
  test::use_memfit_allocator();
  TinyModel m;
  GradScalerOptions o;
  o.init_scale = 4.0;
  o.growth_interval = 3;
  GradScaler scaler(o);
  for (int i = 0; i < 2; ++i) {
    m.backward(scaler);
    scaler.step(m.optimizer);
    scaler.update();
    zero_grad(m.optimizer);
    EXPECT_EQ(scaler.get_scale(), 4.0);
    EXPECT_EQ(scaler.get_growth_tracker(), i + 1);
  }
  m.backward(scaler);
  scaler.step(m.optimizer);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
}

TEST(GradScalerTest, UnscaleGivesTrueGradientsAndStateErrorsMatchPyTorch) {
  test::use_memfit_allocator();
  torch::manual_seed(1);
  TinyModel m;
  auto x = torch::ones({3, 4});
  m.linear(x).pow(2).mean().backward();
  auto reference = m.linear->weight.grad().clone();
  zero_grad(m.optimizer);

  GradScaler scaler;
  m.backward(scaler);
  scaler.unscale_(m.optimizer);
  EXPECT_TRUE(torch::allclose(reference, m.linear->weight.grad(), 1e-6, 1e-7));
  EXPECT_THROW(scaler.unscale_(m.optimizer), c10::Error);  // twice before update
  scaler.step(m.optimizer);
  EXPECT_THROW(scaler.step(m.optimizer), c10::Error);     // step twice
  EXPECT_THROW(scaler.unscale_(m.optimizer), c10::Error);  // unscale after step
  scaler.update();
  EXPECT_THROW(scaler.update(), c10::Error);  // no inf checks recorded since

  GradScaler fresh;
  EXPECT_THROW(fresh.unscale_(m.optimizer), c10::Error);  // scale() never called
}

TEST(GradScalerTest, WorksWithAccumulationAndClipping) {
  test::use_memfit_allocator();
  torch::manual_seed(2);
  TinyModel m;
  GradScaler scaler;
  m.backward(scaler);
  m.backward(scaler);  // two micro-batches accumulate scaled gradients
  scaler.unscale_(m.optimizer);
  torch::nn::utils::clip_grad_norm_(m.linear->parameters(), 0.01);
  EXPECT_LE(m.linear->weight.grad().norm().item<double>(), 0.0100001);
  EXPECT_FALSE(scaler.step(m.optimizer).skipped);
  scaler.update();
}

TEST(GradScalerTest, StateDictRoundTrips) {
  test::use_memfit_allocator();
  TinyModel m;
  GradScalerOptions o;
  o.growth_interval = 5;
  GradScaler a(o);
  m.backward(a);
  a.step(m.optimizer);
  a.update();
  auto state = a.state_dict();
  EXPECT_EQ(state.at("_growth_tracker"), 1.0);
  GradScaler b;
  b.load_state_dict(state);
  EXPECT_EQ(b.state_dict(), state);
  EXPECT_THROW(b.load_state_dict({}), c10::Error);
  GradScalerOptions off;
  off.enabled = false;
  EXPECT_TRUE(GradScaler(off).state_dict().empty());
}

// --- log by value and the leak detector ---

// Runs `steps` training steps of a tiny model, optionally keeping every loss tensor (the
// classic leak), and returns the detector's verdict.
std::optional<LeakReport> run_loop(bool keep_losses, int steps) {
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  LeakDetector detector;
  RunningMean running;
  std::vector<at::Tensor> kept;
  std::optional<LeakReport> report;
  for (int step = 1; step <= steps; ++step) {
    if (auto r = detector.observe(step, tracker->current(test::cpu_counted()))) report = r;
    auto x = torch::randn({16, 32});
    auto loss = model->forward(x).pow(2).mean();
    loss.backward();
    optimizer.step();
    zero_grad(optimizer);
    if (keep_losses) kept.push_back(loss);  // holds the graph (and its activations) alive
    running.add(loss);                       // by value: holds nothing
  }
  EXPECT_EQ(running.count(), steps);
  return report;
}

TEST(LeakDetectorTest, FlagsALoopThatKeepsLossTensors) {
  auto report = run_loop(/*keep_losses=*/true, 8);
  ASSERT_TRUE(report.has_value());
  EXPECT_GT(report->bytes_per_step, 0);
  EXPECT_NE(report->message().find("per step"), std::string::npos);
}

TEST(LeakDetectorTest, QuietOnACleanLoop) { EXPECT_FALSE(run_loop(/*keep_losses=*/false, 8).has_value()); }

}  // namespace
}  // namespace memfit
