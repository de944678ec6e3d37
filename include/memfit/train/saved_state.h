// saved_state.h — training state on disk, one part at a time, checked before it is trusted.
//
// A saved step is several files in DIR, named by the manifest DIR/state.json (format 3) with
// each one's size and sha256:
//   state-<step>.json           the head (JSON: no LibTorch parser reads it): a meta record
//                               (step, batch, seed, model, the plan as plan_json), the optimizer
//                               spec, the part count, the random generators (CPU, and CUDA on a
//                               CUDA device) as hex
//   state-<step>.part-<k>.pt    part k of the model: one block of a Chain (one direct submodule
//                               of any module), its parameters and buffers by name, and each
//                               parameter's optimizer state (any family, runtime/optimizer.h)
// Parts let a writer hold one block at a time: ZeRO 3 gathers block k on rank 0, writes its
// part and lets it go, so saving never needs the whole model on one rank.
//
// Saving writes the parts, then the head, then the manifest (a temporary renamed over the old
// one: the commit point), then removes what the manifest no longer names; a kill at any moment
// leaves a manifest and the files it names intact. Resuming verifies size and checksum of
// every file the manifest names before anything is parsed (and each part's bytes again as it
// parses them), and removes leftovers of an interrupted save.
#pragma once

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "memfit/digest.h"
#include "memfit/runtime/optimizer.h"

namespace memfit {

// The meta record a training run saves in the head: what a resumed run must match (model,
// batch, optimizer) and the plan it continues with (plan_json; read with plan_from_json).
// One JSON form, read as strictly as plans: every field present and of its type.
struct SavedMeta {
  static constexpr int kVersion = 3;
  int64_t step = 0;
  int64_t batch = 0;
  uint64_t seed = 0;
  std::string model;              // the workload's description
  int64_t parameters = 0;         // of the whole model
  OptimizerFamily optimizer = OptimizerFamily::kAdamW;
  StatePrecision optimizer_state = StatePrecision::kFP32;
  nlohmann::json plan;            // plan_json of the plan that ran

  nlohmann::json to_json() const;
  // Throws std::invalid_argument naming the field that is missing or malformed, or a version
  // other than kVersion.
  static SavedMeta from_json(const nlohmann::json& json);
};

// One part of a model's state: named parameters (with their optimizer state) and buffers.
struct StatePart {
  std::vector<std::string> parameter_names;
  std::vector<at::Tensor> parameters;
  // Per parameter; none before the optimizer's first step on it.
  std::vector<std::optional<ParamStateRecord>> parameter_state;
  std::vector<std::string> buffer_names;
  std::vector<at::Tensor> buffers;
};

// The parts `model` is saved in, holding its own tensors (not copies), without optimizer
// state: one per direct submodule in registration order (for a Chain: block k is part k),
// preceded by one for tensors registered on `model` itself if it has any. A tensor shared by
// two submodules belongs to the first.
std::vector<StatePart> state_parts(const torch::nn::Module& model);
// Fills `part.parameter_state` from `optimizer` (found by parameter, any family).
void read_optimizer_state(StatePart& part, const torch::optim::Optimizer& optimizer);
// The state of `parameters` (the part's, in another order: Chain::block_parameters), matched
// by tensor: put on the part's parameters (`state` empty: none), or read from them.
using ParameterStates = std::vector<std::optional<ParamStateRecord>>;
void put_parameter_state(StatePart& part, const std::vector<at::Tensor>& parameters, const ParameterStates& state);
ParameterStates parameter_state_of(const StatePart& part, const std::vector<at::Tensor>& parameters);

// One save of step `step` into DIR (created if needed): parts first, in order, then commit().
class StateWriter {
 public:
  StateWriter(std::filesystem::path dir, int64_t step);
  // Writes the next part's file (flushed, renamed into place; named by no manifest yet).
  void write_part(const StatePart& part);
  // Writes the head, then the manifest naming the head and every part (the commit point), then
  // removes the files it does not name.
  void commit(const nlohmann::json& meta, const OptimizerSpec& spec, c10::Device device);

 private:
  std::filesystem::path dir_;
  int64_t step_;
  nlohmann::json files_ = nlohmann::json::array();
};

// Writes the whole state of one process: every part of `model` with `optimizer`'s state
// (built from `spec`), and meta["step"]'s head.
void save_state(const std::filesystem::path& dir, const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                const OptimizerSpec& spec, const nlohmann::json& meta, c10::Device device);

// A saved state whose files matched their checksums.
class SavedState {
 public:
  // Verifies DIR's manifest and files, and reads the head. Throws std::runtime_error (one line
  // naming the file) if the manifest is missing or malformed, or a file is missing, of another
  // size or checksum, or the head cannot be read.
  static SavedState open(const std::filesystem::path& dir);

  const nlohmann::json& meta() const { return meta_; }
  const std::filesystem::path& file() const { return head_; }
  int parts() const { return static_cast<int>(parts_.size()); }
  // Part k, read and checked again against the manifest (one line if it changed since open).
  StatePart read_part(int k) const;
  // Loads the parameters, buffers and optimizer state (of `spec`: its hyperparameters stay the
  // running optimizer's) part by part, then the random generators. Throws std::runtime_error
  // (one line) if the parts do not fit `model`'s by count, name and shape.
  void load_into(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec, c10::Device device);
  // The random generators as saved, restored (load_into does it too).
  void restore_generators(c10::Device device) const;

 private:
  struct File {
    std::filesystem::path path;
    int64_t bytes = 0;
    std::string sha256;
  };
  File head_file_;
  std::filesystem::path head_;
  std::vector<File> parts_;
  nlohmann::json meta_;
  at::Tensor rng_cpu_, rng_cuda_;
};

// Throws std::runtime_error ("cannot resume: WHERE holds another model or optimizer than this
// run's (...)") unless `saved` has `live`'s parameter and buffer names, shapes and dtypes, and
// each saved optimizer state the slots `spec` keeps for that parameter.
void check_part_fits(const StatePart& saved, const StatePart& live, const OptimizerSpec& spec, const std::string& where);
// Copies the saved parameters and buffers into `live`'s (checked first: check_part_fits).
void copy_part_tensors(const StatePart& saved, const StatePart& live);

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
