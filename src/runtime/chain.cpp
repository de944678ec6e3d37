#include "memfit/runtime/chain.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "memfit/compat.h"
#include "memfit/errors.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/techniques/activation_offload.h"

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
  input_writes_.push_back(InputWrites::kUnknown);
}

std::string Chain::describe_block(int index) const {
  const std::string& name = block(index).name;
  const std::string number = std::to_string(index);
  // A TorchScript block is "<child>:<type>": "block 2:relu (ReLU)", or "block 2 (ReLU)" where
  // the child is named by its index.
  const size_t colon = name.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == name.size()) return "block " + number + " (" + name + ")";
  const std::string child = name.substr(0, colon), type = name.substr(colon + 1);
  return "block " + number + (child == number ? "" : ":" + child) + " (" + type + ")";
}

bool Chain::may_write_input(int index) const {
  return input_writes_.at(static_cast<size_t>(index)) != InputWrites::kNo;
}

void Chain::learn_input_writes(const at::Tensor& input) {
  if (std::none_of(input_writes_.begin(), input_writes_.end(), [](InputWrites w) { return w == InputWrites::kUnknown; })) {
    return;
  }
  at::NoGradGuard no_grad;
  run_blocks(input.clone(), 0, size() - 1);
}

namespace {

// `tensors` without repeats of the same tensor, in first-seen order.
std::vector<at::Tensor> each_once(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& t : tensors) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> Chain::block_parameters(int first, int last) const {
  std::vector<at::Tensor> out;
  for (int i = first; i <= last; ++i) {
    for (const auto& p : block(i).module->parameters()) out.push_back(p);
  }
  return each_once(out);
}

std::vector<at::Tensor> Chain::parameters(bool recurse) const {
  return each_once(torch::nn::Module::parameters(recurse));
}

std::vector<int> Chain::parameter_blocks() const {
  std::unordered_map<const c10::TensorImpl*, int> last_holder;
  for (int i = 0; i < size(); ++i) {
    for (const auto& p : block(i).module->parameters()) last_holder[p.unsafeGetTensorImpl()] = i;
  }
  std::vector<int> out;
  for (const auto& p : parameters()) out.push_back(last_holder.at(p.unsafeGetTensorImpl()));
  return out;
}

std::vector<at::Tensor> Chain::block_buffers(int first, int last) const {
  std::vector<at::Tensor> out;
  for (int i = first; i <= last; ++i) {
    for (const auto& b : block(i).module->buffers()) out.push_back(b);
  }
  return out;
}

namespace {

// The input's version counter, or -1 where it has none (inference tensors).
int64_t version_of(const at::Tensor& x) {
  return x.defined() && !x.is_inference() ? static_cast<int64_t>(x._version()) : -1;
}

// What was running when a block failed: a recompute (in backward), a forward without grad (a
// checkpointed segment's first pass, evaluation), or a forward.
const char* running_phase() {
  const MemoryTracker* tracker = MemoryTracker::active();
  if (tracker != nullptr && tracker->phase() == Phase::kRecompute) return "recomputing in backward";
  return at::GradMode::is_enabled() ? "forward" : "forward without grad";
}

}  // namespace

at::Tensor Chain::run_block(int index, const at::Tensor& x, const char* running) {
  BlockTagGuard tag(static_cast<int16_t>(index));
  const int64_t version = version_of(x);
  at::Tensor y;
  const auto failed = [&](const std::string& what) {
    const std::string phase = running != nullptr ? running : running_phase();
    return compat::error_without_backtrace(describe_block(index) + ", " + phase + ": " + error_cause(what));
  };
  try {
    y = blocks_[static_cast<size_t>(index)].forward(x);
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    throw failed(e.what_without_backtrace());
  } catch (const std::runtime_error& e) {  // the TorchScript interpreter's errors
    throw failed(e.what());
  }
  if (version >= 0) {
    input_writes_[static_cast<size_t>(index)] = version_of(x) != version ? InputWrites::kYes : InputWrites::kNo;
  }
  return y;
}

at::Tensor Chain::run_blocks(const at::Tensor& input, int first, int last) {
  at::Tensor x = input;
  for (int i = first; i <= last; ++i) x = run_block(i, x);
  return x;
}

// The caller's input, or a copy where block 0 runs plainly on it and is known to write into it:
// the caller may run it again (micro-batches replayed after running out of memory, profiling).
at::Tensor Chain::own_input(const at::Tensor& input) const {
  if (size() == 0 || input_writes_.front() != InputWrites::kYes) return input;
  return input.clone();  // a node of the graph where the input requires grad: its gradient arrives
}

at::Tensor Chain::run_through_runner(const at::Tensor& input) {
  at::Tensor x = input;
  for (int i = 0; i < size(); ++i) {
    const BlockFn run = [this, i](const at::Tensor& in) { return run_blocks(in, i, i); };
    if (on_block_start_) on_block_start_(i, x);
    x = runner_(i, x, run);
  }
  return x;
}

at::Tensor Chain::run_plain(const at::Tensor& input, int first, int last, const std::vector<int>& offloaded,
                            std::shared_ptr<OffloadedActivations>& waiting) {
  at::Tensor x = input;
  for (int k = first; k <= last; ++k) {
    std::shared_ptr<OffloadedActivations> saved;
    if (on_block_start_) on_block_start_(k, x);
    if (!std::binary_search(offloaded.begin(), offloaded.end(), k)) {
      x = run_block(k, x);
    } else {
      std::vector<at::Tensor> stay = block_parameters(k, k);
      for (auto& b : block_buffers(k, k)) stay.push_back(std::move(b));
      x = run_offloaded([this, k](const at::Tensor& in) { return run_block(k, in); }, x, stay, &saved);
    }
    prefetch_when_reached(x, std::exchange(waiting, saved));
  }
  return x;
}

at::Tensor Chain::forward(const at::Tensor& input, const CheckpointPlan& plan, const std::vector<int>& offloaded) {
  if (runner_) return run_through_runner(input);
  at::Tensor x = plan.recomputes(0) ? input : own_input(input);  // (a checkpoint copies its own)
  // An offloaded block's activations come back while the unit after it runs its backward.
  std::shared_ptr<OffloadedActivations> waiting;
  int next = 0;
  for (const auto& [first, last] : plan.segments) {
    TORCH_CHECK(first >= next && last >= first && last < size(),
                "memfit::Chain: checkpoint segments must be sorted, disjoint and inside 0..",
                size() - 1, "; got ", plan.describe());
    if (first > next) x = run_plain(x, next, first - 1, offloaded, waiting);
    // The tag is set inside the block function too, so recomputed bytes carry block indices.
    const int f = first, l = last;
    x = checkpoint([this, f, l](const at::Tensor& in) { return run_blocks(in, f, l); }, x,
                   block_parameters(first, last), block_buffers(first, last), input_writes(first));
    prefetch_when_reached(x, std::exchange(waiting, nullptr));
    next = last + 1;
  }
  if (next < size()) x = run_plain(x, next, size() - 1, offloaded, waiting);
  return x;
}

std::vector<std::string> Chain::block_names() const {
  std::vector<std::string> names;
  for (const auto& b : blocks_) names.push_back(b.name);
  return names;
}

}  // namespace memfit
