// A TorchScript model (runtime/torchscript.h) under autocast, its checkpointed blocks recomputed
// on a thread other than the one that ran forward, as CUDA's autograd engine recomputes them
// on its device thread: the blocks run op by op there too, and the gradients equal those of
// the same step whose backward ran on the caller's thread.
#include "test_util.h"

#include <torch/script.h>
#include <torch/serialize.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

// An op that notes, on every call, whether the graph executor would optimize on the thread
// running it: the scripted blocks below call it, so every forward and recompute reports.
std::atomic<int> g_runs{0}, g_runs_optimizing{0};
at::Tensor probe_executor(const at::Tensor& x) {
  ++g_runs;
  if (torch::jit::getGraphExecutorOptimize()) ++g_runs_optimizing;
  return x;
}
TORCH_LIBRARY(memfit_test, m) { m.def("probe_executor", &probe_executor); }

// The names scripted code below sees: TorchScript's own, and `memfit_test` for the probe's ops.
struct ProbeResolver : torch::jit::Resolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction& f,
                                                         const torch::jit::SourceRange& loc) override {
    if (name == "memfit_test") return std::make_shared<torch::jit::BuiltinModule>("memfit_test");
    return torch::jit::nativeResolver()->resolveValue(name, f, loc);
  }
  c10::TypePtr resolveType(const std::string& name, const torch::jit::SourceRange& loc) override {
    return torch::jit::nativeResolver()->resolveType(name, loc);
  }
};

namespace memfit {
namespace {

// A scripted nn.Sequential of `n` blocks (x @ w + b, then GELU), saved to `path`, with data of
// 64 samples of 16 features and 16 float targets beside it.
void save_scripted_model(const std::string& model_path, const std::string& data_path, int n) {
  torch::manual_seed(11);
  torch::jit::Module root(c10::QualifiedName("__torch__.torch.nn.modules.container.Sequential"));
  for (int i = 0; i < n; ++i) {
    torch::jit::Module block(c10::QualifiedName("__torch__.Block" + std::to_string(i)));
    block.register_parameter("weight", (torch::randn({16, 16}) * 0.3).requires_grad_(true), false);
    block.register_parameter("bias", torch::zeros({16}).requires_grad_(true), false);
    // Enough ops that an optimizing executor would differentiate them as one graph.
    block.define(
        "def forward(self, x):\n"
        "  h = torch.matmul(x, self.weight) + self.bias\n"
        "  h = torch.tanh(h) * 0.5 + h\n"
        "  h = torch.matmul(h, self.weight) - self.bias\n"
        "  h = torch.sigmoid(h) * h\n"
        "  return torch.gelu(memfit_test.probe_executor(h) + x)\n",
        std::make_shared<ProbeResolver>());
    root.register_module(std::to_string(i), block);
  }
  root.save(model_path);
  c10::Dict<std::string, at::Tensor> data;
  data.insert("inputs", torch::randn({64, 16}));
  data.insert("targets", torch::randn({64, 16}));
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(data));
  std::ofstream(data_path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// One bf16 step's gradients, every block recomputed; backward on another thread or not.
std::vector<at::Tensor> bf16_gradients(Workload& w, bool backward_elsewhere) {
  zero_grad(w.chain->parameters(), true);
  const Batch b = w.data->train_batch(0, 16, w.seed);
  at::Tensor loss;
  {
    Autocast autocast(c10::kCPU, Precision::kBF16);
    loss = w.loss(w.chain->forward(b.input, CheckpointPlan::all(w.chain->size())), b.target);
  }
  const auto backward = [&loss] { loss.backward(); };
  if (backward_elsewhere) {
    std::exception_ptr error;
    std::thread t([&] {
      try {
        backward();
      } catch (...) {
        error = std::current_exception();
      }
    });
    t.join();
    if (error) std::rethrow_exception(error);
  } else {
    backward();
  }
  std::vector<at::Tensor> grads;
  for (const auto& p : w.chain->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

TEST(TorchScriptTest, Bf16RecomputeOnAnotherThreadRunsAsOnTheCallers) {
  test::use_memfit_allocator();
  const auto dir = std::filesystem::temp_directory_path() / ("memfit-script-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string model = (dir / "model.pt").string(), data = (dir / "data.pt").string();
  save_scripted_model(model, data, 3);
  ScriptWorkloadOptions o;
  o.model_file = model;
  o.data_file = data;
  o.loss = LossKind::kMse;
  Workload w = load_script_workload(o);
  ASSERT_EQ(w.chain->size(), 3);
  const std::vector<at::Tensor> here = bf16_gradients(w, false);
  EXPECT_GT(g_runs.load(), 0);
  // Several steps: the graph executor optimizes a graph only after profiling runs of it.
  for (int step = 0; step < 4; ++step) {
    const std::vector<at::Tensor> elsewhere = bf16_gradients(w, true);
    ASSERT_EQ(here.size(), elsewhere.size());
    for (size_t i = 0; i < here.size(); ++i) {
      EXPECT_TRUE(here[i].equal(elsewhere[i])) << "step " << step << ", parameter " << i;
    }
  }
  EXPECT_EQ(g_runs_optimizing.load(), 0) << "of " << g_runs.load() << " block runs, forward and recompute";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace memfit
