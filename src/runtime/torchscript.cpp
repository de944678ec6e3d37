#include "memfit/runtime/torchscript.h"

#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/script.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <fstream>
#include <iterator>
#include <sstream>

#include "memfit/digest.h"
#include "memfit/errors.h"

namespace memfit {
namespace {

std::string whole_error(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
}

// The line that says what went wrong (for an interpreter error, the innermost one).
std::string cause_of(const std::exception& e) { return error_cause(whole_error(e)); }

// A scripted module as a torch::nn::Module block: its parameters and buffers registered under
// flattened names ("fc.weight" -> "fc_weight"), the same tensors the scripted module holds.
class ScriptBlock : public torch::nn::Module {
 public:
  explicit ScriptBlock(torch::jit::Module module) : module_(std::move(module)) {
    for (const auto& p : module_.named_parameters(/*recurse=*/true)) register_parameter(flat(p.name), p.value, p.value.requires_grad());
    for (const auto& b : module_.named_buffers(/*recurse=*/true)) register_buffer(flat(b.name), b.value);
  }
  at::Tensor forward(const at::Tensor& x) { return run({x}); }

  // The module's forward on `inputs`; an out-of-memory error inside it stays one.
  //
  // It runs op by op, as eager PyTorch runs it, on whichever thread runs it: the graph
  // executor's optimizing mode differentiates whole graphs itself (DifferentiableGraph), whose
  // backward ignores autocast's casts (LibTorch 2.11, CUDA: a bf16 step fails with a dtype
  // mismatch in mm's backward). The setting is thread-local, and a checkpointed block's
  // recompute runs on autograd's device thread, so it is held here, around every run.
  at::Tensor run(std::vector<c10::IValue> inputs) {
    torch::jit::GraphOptimizerEnabledGuard op_by_op(false);
    try {
      return module_.forward(std::move(inputs)).toTensor();
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const std::exception& e) {
      // The interpreter wraps the allocator's out-of-memory error in its own: give it back its
      // type, so that out-of-memory recovery sees it.
      const std::string what = whole_error(e);
      const size_t at = what.find("out of memory");
      if (at == std::string::npos) throw;
      const size_t start = what.rfind('\n', at);
      const std::string line = what.substr(start == std::string::npos ? 0 : start + 1);
      TORCH_CHECK_WITH(OutOfMemoryError, false, line.substr(0, line.find('\n')));
    }
  }
  void train(bool on) override {
    torch::nn::Module::train(on);
    module_.train(on);  // dropout and BatchNorm inside the scripted module follow
  }
  torch::jit::Module& script() { return module_; }

 private:
  static std::string flat(std::string name) {
    for (char& c : name) c = c == '.' ? '_' : c;
    return name;
  }
  torch::jit::Module module_;
};



std::string shape_text(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes() << " " << c10::toString(t.scalar_type());
  return out.str();
}

torch::jit::Module load_module(const std::string& file) {
  try {
    return torch::jit::load(file);
  } catch (const std::exception& e) {
    throw OptionError("model", "'" + file + "'", "expected a TorchScript file (torch.jit.script(model).save(...)): " + cause_of(e));
  }
}

std::pair<at::Tensor, at::Tensor> load_data(const std::string& file) {
  const std::string expected = "expected a file written by torch.save({\"inputs\": X, \"targets\": Y})";
  std::ifstream in(file, std::ios::binary);
  check_option(static_cast<bool>(in), "data", "'" + file + "'", "cannot read it");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw OptionError("data", "'" + file + "'", expected + " (" + cause_of(e) + ")");
  }
  check_option(value.isGenericDict(), "data", "'" + file + "'", expected + ": it holds no dict");
  const auto dict = value.toGenericDict();
  for (const char* key : {"inputs", "targets"}) {
    check_option(dict.contains(key) && dict.at(key).isTensor(), "data", "'" + file + "'",
                 expected + ": the tensor \"" + key + "\" is missing");
  }
  return {dict.at("inputs").toTensor(), dict.at("targets").toTensor()};
}

LossFn make_loss(LossKind kind, const std::shared_ptr<ScriptBlock>& whole) {
  switch (kind) {
    case LossKind::kCrossEntropy:
      return [](const at::Tensor& out, const at::Tensor& target) {
        return torch::cross_entropy_loss(out.reshape({-1, out.size(-1)}), target.reshape({-1}).to(at::kLong));
      };
    case LossKind::kMse:
      return [](const at::Tensor& out, const at::Tensor& target) { return torch::mse_loss(out, target.to(out.scalar_type())); };
    case LossKind::kModel:
      return [whole](const at::Tensor& inputs, const at::Tensor& target) {
        return whole->run({inputs, target});
      };
  }
  TORCH_CHECK(false, "memfit: unknown loss kind");
}

bool is_sequential(const torch::jit::Module& m) {
  const auto name = m.type()->name();
  // "__torch__.torch.nn.modules.container.Sequential", or with a "___torch_mangle_N" part when
  // the file holds several Sequential types.
  return name && name->name() == "Sequential" && name->qualifiedName().find("torch.nn.modules.container") != std::string::npos;
}

// The chain: the Sequential's children, or the whole module as one block (for --loss model the
// block passes the inputs on and the loss runs the module).
std::shared_ptr<Chain> make_chain(const torch::jit::Module& root, LossKind loss, std::shared_ptr<ScriptBlock>& whole,
                                  std::vector<std::string>& notes) {
  auto chain = std::make_shared<Chain>();
  if (loss != LossKind::kModel && is_sequential(root)) {
    for (const auto& child : root.named_children()) {
      auto block = std::make_shared<ScriptBlock>(child.value);
      const auto type = child.value.type()->name();
      const std::string type_name = type ? type->name() : "Module";
      chain->add(child.name + ":" + type_name, block, [block](const at::Tensor& x) { return block->forward(x); });
    }
    if (chain->size() > 0) return chain;
  }
  whole = std::make_shared<ScriptBlock>(root);
  if (loss == LossKind::kModel) {
    chain->add("model", whole, [](const at::Tensor& x) { return x; });
    notes.push_back("`loss` model: the module runs as one block inside the loss; no block can be recomputed");
  } else {
    chain->add("model", whole, [w = whole](const at::Tensor& x) { return w->forward(x); });
    notes.push_back("the model runs as one block: recomputation needs it exported as an nn.Sequential of blocks");
  }
  return chain;
}

// One sample through the model and the loss, without grad: a mismatch is one clear line now
// rather than a LibTorch error in the middle of profiling.
void check_runs(Workload& w) {
  const Batch b = w.data->train_batch(0, 1, w.seed);
  at::NoGradGuard no_grad;
  at::Tensor out;
  try {
    out = w.chain->forward(b.input);
  } catch (const std::exception& e) {
    throw OptionError("model", "'" + w.name + "'", "its forward fails on inputs of shape " + shape_text(b.input) + ": " + cause_of(e));
  }
  try {
    const at::Tensor loss = w.loss(out, b.target);
    TORCH_CHECK(loss.numel() == 1, "the loss is not a scalar but ", loss.sizes());
  } catch (const std::exception& e) {
    throw OptionError("loss", "for output " + shape_text(out) + " and targets " + shape_text(b.target), cause_of(e));
  }
}

}  // namespace

LossKind parse_loss_kind(const std::string& text) {
  if (text == "cross-entropy") return LossKind::kCrossEntropy;
  if (text == "mse") return LossKind::kMse;
  if (text == "model") return LossKind::kModel;
  throw OptionError("loss", "'" + text + "'", "expected cross-entropy, mse or model");
}

Workload load_script_workload(const ScriptWorkloadOptions& o) {
  check_option(!o.data_file.empty(), "data", "(none)", "a TorchScript model needs its data: a file of torch.save({\"inputs\": X, \"targets\": Y})");
  torch::jit::Module root = load_module(o.model_file);
  root.train(true);
  auto [inputs, targets] = load_data(o.data_file);
  Workload w;
  w.name = o.model_file;
  std::shared_ptr<ScriptBlock> whole;
  w.chain = make_chain(root, o.loss, whole, w.notes);
  w.data = std::make_shared<TensorDataset>(inputs, targets, o.data_file, o.eval_share);
  w.loss = make_loss(o.loss, whole);
  w.seed = o.seed;
  w.sample_tokens = inputs.dim() == 2 && !inputs.is_floating_point() ? inputs.size(1) : 1;
  w.description = o.model_file + ": " + std::to_string(w.chain->size()) + " block(s), " +
                  std::to_string(parameter_count(*w.chain)) + " parameters; " + w.data->describe();
  w.fingerprint = "model " + sha256_file(o.model_file) + ", loss " + std::to_string(static_cast<int>(o.loss));
  w.save_model = [root](const std::string& path) { root.save(path); };
  torch::manual_seed(o.seed);
  check_runs(w);
  return w;
}

}  // namespace memfit
