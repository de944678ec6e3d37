// torchscript.h — the user's own model from Python: a TorchScript file (torch.jit.script(model)
// .save("model.pt")) and its data (torch.save({"inputs": X, "targets": Y}, "data.pt")) as a
// Workload, trained and handed back as a TorchScript file Python loads with torch.jit.load.
//
// Blocks: a scripted nn.Sequential gives one block per child (checkpointable, named
// "<child>:<type>", e.g. "1:Block"); any other module runs as one block, and the workload's
// notes say that recomputation needs the model exported as a Sequential of blocks:
//
//     blocks = nn.Sequential(embed, *layers, head)      # instead of one module calling them
//     torch.jit.script(blocks).save("model.pt")
//
// The chain's blocks hold the scripted modules' own parameter and buffer tensors (no copies):
// the optimizer updates them in place and saving the scripted module saves the trained weights.
#pragma once

#include <string>

#include "memfit/runtime/workload.h"

namespace memfit {

enum class LossKind {
  kCrossEntropy,  // over the last dimension: [..., C] outputs against [...] integer targets
  kMse,           // mean squared error, targets of the output's shape
  kModel,         // the module's forward(inputs, targets) returns the scalar loss
};
// "cross-entropy" | "mse" | "model"; throws OptionError("loss", ...).
LossKind parse_loss_kind(const std::string& text);

struct ScriptWorkloadOptions {
  std::string model_file;        // TorchScript
  std::string data_file;         // torch.save({"inputs": X, "targets": Y})
  LossKind loss = LossKind::kCrossEntropy;
  uint64_t seed = 0;             // the batch stream and dropout (the weights are the file's)
  double eval_share = 0.1;       // the last share of the samples, held out
};

// Loads both files and checks, on one sample, that the model runs on the inputs and the loss
// fits its output and the targets. Throws OptionError (one line: a file that is not TorchScript
// or not a dict of "inputs" and "targets", sample counts that differ, the model's error with the
// input's shape and dtype, the loss's with both shapes).
Workload load_script_workload(const ScriptWorkloadOptions& options);

}  // namespace memfit
