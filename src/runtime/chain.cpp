#include "memfit/runtime/chain.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "memfit/errors.h"
#include "memfit/measure/memory_tracker.h"

namespace memfit {

CheckpointPlan CheckpointPlan::all(int blocks) {
  CheckpointPlan plan;
  for (int i = 0; i < blocks; ++i) plan.segments.emplace_back(i, i);
  return plan;
}

CheckpointPlan CheckpointPlan::every(int k, int blocks) {
  check_option(k >= 1, "checkpoint", "every:" + std::to_string(k), "expected a segment length K >= 1");
  CheckpointPlan plan;
  // 64-bit steps: i + k must not overflow for k and blocks near INT_MAX.
  for (int64_t i = 0; i < blocks; i += k) {
    plan.segments.emplace_back(static_cast<int>(i), static_cast<int>(std::min<int64_t>(i + k, blocks) - 1));
  }
  return plan;
}

CheckpointPlan CheckpointPlan::of_blocks(std::vector<int> indices, int blocks) {
  std::sort(indices.begin(), indices.end());
  indices.erase(std::unique(indices.begin(), indices.end()), indices.end());
  CheckpointPlan plan;
  for (int i : indices) {
    if (i < 0 || i >= blocks) {
      throw OptionError("checkpoint", "block " + std::to_string(i), "the model has blocks 0 to " + std::to_string(blocks - 1));
    }
    plan.segments.emplace_back(i, i);
  }
  return plan;
}

CheckpointPlan CheckpointPlan::parse(const std::string& spec, int blocks) {
  const std::string accepted = "expected none, all, every:K or block indices like 0,2,5";
  if (spec == "none" || spec.empty()) return none();
  if (spec == "all") return all(blocks);
  if (spec.rfind("every:", 0) == 0) {
    try {
      size_t used = 0;
      const int k = std::stoi(spec.substr(6), &used);
      if (used == spec.size() - 6 && k >= 1) return every(k, blocks);
    } catch (const std::exception&) {
    }
    throw OptionError("checkpoint", "'" + spec + "'", accepted + " (K >= 1)");
  }
  std::vector<int> indices;
  std::stringstream in(spec);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int value = -1;
    try {
      value = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size()) {
      throw OptionError("checkpoint", "'" + spec + "'", accepted);
    }
    if (value < 0 || value >= blocks) {
      throw OptionError("checkpoint", "block " + std::to_string(value), "the model has blocks 0 to " + std::to_string(blocks - 1));
    }
    indices.push_back(value);
  }
  return of_blocks(indices, blocks);
}

std::vector<int> CheckpointPlan::recomputed_blocks() const {
  std::vector<int> out;
  for (const auto& [first, last] : segments) {
    for (int i = first; i <= last; ++i) out.push_back(i);
  }
  return out;
}

bool CheckpointPlan::recomputes(int block) const {
  return std::any_of(segments.begin(), segments.end(),
                     [&](const auto& s) { return s.first <= block && block <= s.second; });
}

std::string CheckpointPlan::describe() const {
  if (segments.empty()) return "none";
  std::string out;
  for (const auto& [first, last] : segments) {
    if (!out.empty()) out += ",";
    out += first == last ? std::to_string(first) : std::to_string(first) + "-" + std::to_string(last);
  }
  return out;
}

void Chain::add(const std::string& name, std::shared_ptr<torch::nn::Module> module,
                BlockForward forward) {
  const std::string key = std::to_string(blocks_.size()) + "_" + name;
  register_module(key, module);
  blocks_.push_back(Block{name, std::move(module), std::move(forward)});
}

std::vector<at::Tensor> Chain::block_parameters(int first, int last) const {
  std::vector<at::Tensor> out;
  for (int i = first; i <= last; ++i) {
    for (const auto& p : block(i).module->parameters()) out.push_back(p);
  }
  return out;
}

std::vector<at::Tensor> Chain::block_buffers(int first, int last) const {
  std::vector<at::Tensor> out;
  for (int i = first; i <= last; ++i) {
    for (const auto& b : block(i).module->buffers()) out.push_back(b);
  }
  return out;
}

at::Tensor Chain::run_blocks(const at::Tensor& input, int first, int last) {
  at::Tensor x = input;
  for (int i = first; i <= last; ++i) {
    BlockTagGuard tag(static_cast<int16_t>(i));
    x = blocks_[static_cast<size_t>(i)].forward(x);
  }
  return x;
}

at::Tensor Chain::run_through_runner(const at::Tensor& input) {
  at::Tensor x = input;
  for (int i = 0; i < size(); ++i) {
    const BlockFn run = [this, i](const at::Tensor& in) { return run_blocks(in, i, i); };
    x = runner_(i, x, run);
  }
  return x;
}

at::Tensor Chain::forward(const at::Tensor& input, const CheckpointPlan& plan) {
  if (runner_) return run_through_runner(input);
  at::Tensor x = input;
  int next = 0;
  for (const auto& [first, last] : plan.segments) {
    TORCH_CHECK(first >= next && last >= first && last < size(),
                "memfit::Chain: checkpoint segments must be sorted, disjoint and inside 0..",
                size() - 1, "; got ", plan.describe());
    if (first > next) x = run_blocks(x, next, first - 1);
    // The tag is set inside the block function too, so recomputed bytes carry block indices.
    const int f = first, l = last;
    x = checkpoint([this, f, l](const at::Tensor& in) { return run_blocks(in, f, l); }, x,
                   block_parameters(first, last), block_buffers(first, last));
    next = last + 1;
  }
  if (next < size()) x = run_blocks(x, next, size() - 1);
  return x;
}

std::vector<std::string> Chain::block_names() const {
  std::vector<std::string> names;
  for (const auto& b : blocks_) names.push_back(b.name);
  return names;
}

}  // namespace memfit
