// saved_state.h — training state on disk, checked before it is trusted.
//
// DIR/state-<step>.pt holds the model's parameters and buffers, the optimizer's state (any
// family), the random generators (CPU, and CUDA on a CUDA device) and a meta record (step,
// batch, seed, model, the plan as plan_json). DIR/state.json, the manifest, names that file
// with its size and sha256. Saving writes the new state file, then the manifest (a temporary
// renamed over the old one: the commit point), then removes what the manifest no longer names;
// a kill at any moment leaves a manifest and the file it names intact. Resuming verifies size
// and checksum of every file the manifest names before anything is parsed, and removes
// leftovers of an interrupted save.
#pragma once

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "memfit/digest.h"

namespace memfit {

// Writes the state of step meta["step"] into DIR (created if needed), atomically.
void save_state(const std::filesystem::path& dir, const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                const nlohmann::json& meta, c10::Device device);

// A saved state whose files matched their checksums.
class SavedState {
 public:
  // Verifies DIR's manifest and files. Throws std::runtime_error (one line naming the file) if
  // the manifest is missing or malformed, or a file is missing, of another size or checksum.
  static SavedState open(const std::filesystem::path& dir);

  const nlohmann::json& meta() const { return meta_; }
  const std::filesystem::path& file() const { return file_; }
  // Loads the model, the optimizer and the random generators. Throws std::runtime_error (one
  // line) if they do not fit the saved ones.
  void load_into(torch::nn::Module& model, torch::optim::Optimizer& optimizer, c10::Device device);

 private:
  std::filesystem::path file_;
  nlohmann::json meta_;
  std::shared_ptr<torch::serialize::InputArchive> archive_;
};

// Removes from DIR what an interrupted save left: temporaries, and state files the manifest
// does not name. Returns how many files it removed.
int remove_stale_state_files(const std::filesystem::path& dir);

// sha256 as lowercase hex over the bytes of all parameters of a module, in order (of any bytes:
// memfit/digest.h).
std::string weights_sha256(const torch::nn::Module& module);
// The same hash over the parameters `visit_all` passes to its visitor, in order (ZeRO 3
// gathers them one block at a time).
using ParameterVisitor = std::function<void(const at::Tensor&)>;
std::string weights_sha256(const std::function<void(const ParameterVisitor&)>& visit_all);

}  // namespace memfit
