// Where memory goes: the breakdown of `memfit report`, checked against the allocator's bytes.
#include "test_util.h"

namespace memfit {
namespace {

Report gpt_report(int64_t batch) { return test::report_of(test::small_gpt(), test::report_options(batch)); }

TEST(ReportTest, StatesEqualParameterBytes) {
  Report r = gpt_report(8);
  EXPECT_GT(r.parameter_bytes, 0);
  EXPECT_EQ(r.parameter_bytes, r.parameters * 4);  // fp32
  EXPECT_EQ(r.states.weights, r.parameter_bytes);
  EXPECT_EQ(r.states.gradients, r.parameter_bytes);
  // AdamW: exp_avg and exp_avg_sq per parameter; its step count is a plain integer in LibTorch.
  EXPECT_EQ(r.states.optimizer_state, 2 * r.parameter_bytes);
}

TEST(ReportTest, PartsAtPeakSumToPeak) {
  Report r = gpt_report(8);
  const auto& p = r.analysis.at_peak;
  EXPECT_EQ(p.weights + p.buffers + p.gradients + p.optimizer_state + p.activations + p.other, r.analysis.peak_bytes);
  EXPECT_EQ(p.weights, r.parameter_bytes);
  EXPECT_EQ(p.optimizer_state, 2 * r.parameter_bytes);
  EXPECT_GT(p.activations, 0);
  // The analysed peak is the tracker's own peak for that step.
  int64_t phase_max = 0;
  for (auto v : r.phase_peak) phase_max = std::max(phase_max, v);
  EXPECT_EQ(r.analysis.peak_bytes, phase_max);
  // Per-block activations: every block keeps something, attention halves the most.
  ASSERT_EQ(r.analysis.block_activation_bytes.size(), 14u);
  for (auto b : r.analysis.block_activation_bytes) EXPECT_GT(b, 0);
  EXPECT_GT(r.analysis.block_activation_bytes[1], r.analysis.block_activation_bytes[2]);
}

TEST(ReportTest, ActivationsGrowLinearlyWithBatch) {
  Report small = gpt_report(4);
  Report big = gpt_report(8);
  const double ratio = static_cast<double>(big.analysis.at_peak.activations) /
                       static_cast<double>(small.analysis.at_peak.activations);
  EXPECT_GE(ratio, 1.8);
  EXPECT_LE(ratio, 2.2);
}

TEST(ReportTest, JsonHasTheDocumentedFields) {
  Report r = gpt_report(4);
  auto j = report_json(r);
  for (const char* key : {"model", "parameters", "peak_bytes", "at_peak", "states", "phases", "blocks"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["peak_bytes"].get<int64_t>(), r.analysis.peak_bytes);
  EXPECT_TRUE(j["phases"].contains("forward"));
  EXPECT_TRUE(j["phases"].contains("backward"));
  EXPECT_TRUE(j["phases"].contains("optimizer"));
  auto doc = report_document(r).to_json();
  EXPECT_EQ(doc["timeline"].size(), r.analysis.timeline.size());
}

TEST(ReportTest, ImageModelsRunOnFashionMnist) {
  test::use_memfit_allocator();
  for (const char* model : {"cnn", "mlp"}) {
    ModelOptions m;
    m.model = model;
    m.cnn.blocks = 2;
    m.cnn.channels = 8;
    m.mlp.layers = 2;
    m.mlp.width = 64;
    Workload w = make_workload(m);
    int64_t buffer_bytes = 0;  // the CNN's BatchNorm statistics; the MLP has none
    for (const auto& b : w.chain->buffers()) buffer_bytes += static_cast<int64_t>(b.nbytes());
    Report r = run_report(w, test::report_options(8, 2));
    EXPECT_EQ(r.states.weights, r.parameter_bytes) << model;
    EXPECT_EQ(r.states.buffers, buffer_bytes) << model;
    EXPECT_EQ(r.analysis.at_peak.buffers, buffer_bytes) << model;
    EXPECT_EQ(r.analysis.at_peak.total(), r.analysis.peak_bytes) << model;
    EXPECT_TRUE(std::isfinite(r.loss)) << model;
  }
}

// A user's model with BatchNorm: its running statistics are the buffers category, exactly
// their bytes, before and at the peak (not "other"), and the parts still add up.
TEST(ReportTest, BuffersAreTheirOwnCategory) {
  test::use_memfit_allocator();
  torch::manual_seed(3);
  Workload w;
  w.name = "user-bn";
  w.chain = std::make_shared<Chain>();
  w.chain->add("a", torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::BatchNorm1d(64), torch::nn::ReLU()).ptr());
  w.chain->add("b", torch::nn::Sequential(torch::nn::Linear(64, 4), torch::nn::BatchNorm1d(4)).ptr());
  w.data = std::make_shared<TensorDataset>(torch::randn({256, 16}), torch::randn({256, 4}), "regression");
  w.loss = [](const at::Tensor& out, const at::Tensor& target) { return torch::mse_loss(out, target); };
  // BatchNorm1d(64): running mean + var 2 x 64 fp32 + an int64 count; BatchNorm1d(4) likewise.
  const int64_t buffer_bytes = (2 * 64 * 4 + 8) + (2 * 4 * 4 + 8);
  Report r = run_report(w, test::report_options(32, 2));
  EXPECT_EQ(r.states.buffers, buffer_bytes);
  EXPECT_EQ(r.analysis.at_start.buffers, buffer_bytes);
  EXPECT_EQ(r.analysis.at_peak.buffers, buffer_bytes);
  EXPECT_EQ(r.analysis.at_peak.total(), r.analysis.peak_bytes);
  EXPECT_EQ(r.states.weights, r.parameter_bytes);
}

TEST(ReportTest, DeterministicForASeed) {
  Report a = gpt_report(4);
  Report b = gpt_report(4);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.analysis.peak_bytes, b.analysis.peak_bytes);
}

TEST(ReportTest, BadModelOptionsAreClearErrors) {
  test::use_memfit_allocator();
  ModelOptions o = test::small_gpt();
  o.gpt.heads = 5;
  try {
    make_workload(o);
    FAIL();
  } catch (const OptionError& e) {
    EXPECT_EQ(e.option(), "gpt.heads");
    EXPECT_NE(std::string(e.what()).find("heads 5"), std::string::npos);
  }
  o = test::small_gpt();
  o.model = "rnn";
  EXPECT_THROW(make_workload(o), std::invalid_argument);
  o = test::small_gpt();
  o.data_file = "/nonexistent/file.txt";
  EXPECT_THROW(make_workload(o), std::runtime_error);
}


// --- what the recorded run would reserve on a CUDA device (measure/cuda_reserved.h) ---

TEST(CudaReservedTest, GptRunReservesAtLeastWhatItAllocates) {
  Report r = gpt_report(8);
  ASSERT_TRUE(r.cuda.valid);
  EXPECT_EQ(cuda_allocator_rules_name(r.cuda.rules), std::string(compat::kCudaAllocatorRulesName));
  EXPECT_GE(r.cuda.peak_allocated, r.analysis.peak_bytes);  // blocks are rounded up, never down
  EXPECT_GE(r.cuda.peak_reserved, r.cuda.peak_allocated);
  EXPECT_EQ(r.cuda.peak_reserved % (2 << 20), 0);  // whole 2 MiB segments
  // One reserved value per timeline point of the analysed step, each covering that point's live bytes.
  ASSERT_EQ(r.cuda.reserved_series.size(), r.analysis.timeline.size());
  for (size_t i = 0; i < r.analysis.timeline.size(); ++i) {
    ASSERT_GE(r.cuda.reserved_series[i], r.analysis.timeline[i].live.total()) << "point " << i;
    ASSERT_LE(r.cuda.reserved_series[i], r.cuda.peak_reserved);
  }
  const auto j = report_json(r);
  EXPECT_EQ(j["cuda_reserved_peak_bytes"].get<int64_t>(), r.cuda.peak_reserved);
  EXPECT_EQ(j["cuda_allocator_rules"].get<std::string>(), compat::kCudaAllocatorRulesName);
  const auto doc = report_document(r).to_json();
  EXPECT_EQ(doc["reserved_series"]["peak_bytes"].get<int64_t>(), r.cuda.peak_reserved);
  EXPECT_EQ(doc["timeline"].back()["cuda_reserved"].get<int64_t>(), r.cuda.reserved_series.back());
}

TEST(CudaReservedTest, LargeTwoMiBMultiplesReserveExactlyTheirBytes) {
  // Tensors of 10 to 40 MiB in 2 MiB steps, all kept: each is a CUDA segment of its own size.
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  tracker->start_recording();
  std::vector<at::Tensor> kept;
  for (int64_t mib = 10; mib <= 40; mib += 2) kept.push_back(torch::empty({mib << 20}, torch::kUInt8));
  tracker->stop_recording();
  const CudaReservedPrediction p =
      predict_cuda_reserved(recorded_trace(*tracker), test::cpu_counted(), cuda_prediction_options_from_env());
  EXPECT_EQ(p.peak_reserved, tracker->peak(test::cpu_counted()));
  EXPECT_EQ(p.peak_allocated, tracker->peak(test::cpu_counted()));
}

// Sets an environment variable for a scope, then removes it.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  const char* name_;
};

TEST(CudaReservedTest, MalformedAllocConfIsOneClearLine) {
  ScopedEnv conf("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:ten");
  try {
    gpt_report(2);
    ADD_FAILURE() << "a malformed PYTORCH_CUDA_ALLOC_CONF was accepted";
  } catch (const OptionError& e) {
    EXPECT_EQ(e.option(), "PYTORCH_CUDA_ALLOC_CONF");
    EXPECT_NE(std::string(e.what()).find("max_split_size_mb:ten"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memfit
