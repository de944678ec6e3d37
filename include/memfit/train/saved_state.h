// saved_state.h — training state on disk: the model's parameters and buffers, the optimizer's
// state (any family), the random generators (CPU, and CUDA on a CUDA device) and a meta record
// (step, batch, seed, model, the plan as plan_json). Written to a temporary file, flushed and
// renamed, so a kill at any moment leaves the previous state intact.
#pragma once

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <string>

namespace memfit {

// Writes DIR/state.pt atomically (DIR is created if needed).
void save_state(const std::filesystem::path& dir, const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                const nlohmann::json& meta, c10::Device device);

// Reads DIR/state.pt's meta record only. Throws std::runtime_error (one line) if the file is
// missing, corrupt or truncated.
nlohmann::json load_state_meta(const std::filesystem::path& dir);

// Loads the model, the optimizer and the random generators from DIR/state.pt. Throws
// std::runtime_error (one line) if the file does not match the model or optimizer.
void load_state(const std::filesystem::path& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                c10::Device device);

// sha256 over the bytes of all parameters, in order, as lowercase hex.
std::string weights_sha256(const torch::nn::Module& module);

}  // namespace memfit
