// Uses the installed library as a C++ user would: a model of their own torch::nn modules, their
// own data tensors and loss, trained by memfit::Trainer under a budget the plain step does not
// fit. Exits 0 when the peak stayed under the budget and the loss fell.
#include <memfit/memfit.h>
#include <torch/torch.h>

#include <iostream>
#include <sstream>

int main() {
  torch::manual_seed(0);
  // 512 samples of 64 positions x 32 features; the target is a fixed linear map of them.
  const auto inputs = torch::randn({512, 64, 32});
  const auto targets = inputs.matmul(torch::randn({32, 4}));

  memfit::Workload w;
  w.name = "consumer-mlp";
  w.description = "a user's MLP";
  w.chain = std::make_shared<memfit::Chain>();
  w.chain->add("in", torch::nn::Sequential(torch::nn::Linear(32, 256), torch::nn::ReLU()).ptr());
  w.chain->add("hidden", torch::nn::Sequential(torch::nn::Linear(256, 256), torch::nn::ReLU()).ptr());
  w.chain->add("out", torch::nn::Linear(256, 4).ptr());
  w.data = std::make_shared<memfit::TensorDataset>(inputs, targets, "regression");
  w.loss = [](const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); };

  memfit::TrainOptions o;
  o.step.batch = 32;
  o.steps = 15;
  o.budget_bytes = 8 << 20;  // the plain fp32 step needs about 9.3 MB: micro-batches it is
  o.pin_precision = true;    // step.precision: fp32
  o.step.optimizer.family = memfit::OptimizerFamily::kSGD;
  o.step.optimizer.momentum = 0.9;
  o.step.optimizer.lr = 0.02;
  // An observer of the caller's own: the steps as they come.
  struct Steps : memfit::TrainObserver {
    int seen = 0;
    void on_step(const memfit::StepEvent&) override { ++seen; }
  } steps;
  memfit::Trainer trainer(w, o);
  trainer.add_observer(steps);
  const memfit::TrainSummary s = trainer.run();

  const bool ok = s.peak_bytes <= s.budget_bytes && s.losses.back() < s.losses.front() && s.plan.config.accumulation() > 1 &&
                  steps.seen == o.steps;
  std::cout << "consumer: peak " << s.peak_bytes << " of " << s.budget_bytes << " bytes, " << s.plan.config.describe()
            << ", loss " << s.losses.front() << " -> " << s.losses.back() << ", " << (ok ? "ok" : "FAILED") << "\n";
  return ok ? 0 : 1;
}
