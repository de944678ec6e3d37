#include "flags.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <sstream>
#include <thread>

namespace memfit::cli {

void add_workload_flags(CLI::App& app, WorkloadFlags& f) {
  app.add_option("--model", f.model.model, "gpt | cnn | mlp | FILE (a TorchScript module; needs --data)")->capture_default_str();
  app.add_option("--layers", f.layers, "gpt: transformer layers (8); mlp: hidden layers (4)");
  app.add_option("--d-model", f.model.gpt.d_model, "gpt: model width")->capture_default_str();
  app.add_option("--heads", f.model.gpt.heads, "gpt: attention heads (must divide --d-model)")->capture_default_str();
  app.add_option("--dropout", f.model.gpt.dropout, "gpt: dropout probability")->capture_default_str();
  app.add_option("--seq", f.model.gpt.seq, "gpt: sequence length in characters")->capture_default_str();
  app.add_option("--shortest", f.model.shortest,
                 "gpt: each training batch as long as padding makes it, drawn from this to --seq characters (0: all --seq); "
                 "the plan is made on --seq, each batch planned from its length before it runs")
      ->capture_default_str();
  app.add_option("--data", f.model.data_file,
                 "gpt: a text file instead of the Bible; a TorchScript model: torch.save({\"inputs\": X, \"targets\": Y})");
  app.add_option("--loss", f.loss, "a TorchScript model's loss: cross-entropy | mse | model (its forward(inputs, targets))")
      ->capture_default_str();
  app.add_option("--blocks", f.model.cnn.blocks, "cnn: residual blocks")->capture_default_str();
  app.add_option("--channels", f.model.cnn.channels, "cnn: channels")->capture_default_str();
  app.add_option("--width", f.model.mlp.width, "mlp: hidden width")->capture_default_str();
  app.add_option("--seed", f.model.seed, "seed for weights, batches and dropout")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--threads", f.threads, "LibTorch threads (default: all cores)");
}

void add_step_flags(CLI::App& app, StepFlags& f, bool planned) {
  f.precision = planned ? "auto" : "fp32";
  f.checkpoint = planned ? "auto" : "none";
  f.optimizer_state = planned ? "auto" : "fp32";  // as memfit.plan's: 8-bit where it pays
  app.add_option("--batch", f.batch, "samples per optimizer step")->capture_default_str();
  app.add_option("--micro-batch", f.micro_batch,
                 planned ? "pin the micro-batch size (default: planned)" : "samples per micro-batch (gradient accumulation)");
  app.add_option("--precision", f.precision, planned ? "auto | fp32 | bf16 | fp16" : "fp32 | bf16 | fp16 (autocast)")
      ->capture_default_str();
  app.add_option("--checkpoint", f.checkpoint,
                 std::string(planned ? "auto (solved) | " : "") + "none | all | every:K | i,j,... (blocks recomputed)")
      ->capture_default_str();
  app.add_flag("--keep-grads", f.keep_grads, "zero gradients instead of releasing them (set_to_none off)");
  app.add_option("--device", f.device, "cpu | cuda | cuda:N")->capture_default_str();
  app.add_option("--optimizer", f.optimizer, "adamw | adam | sgd | rmsprop | adagrad")->capture_default_str();
  app.add_option("--lr", f.lr, "learning rate")->capture_default_str();
  app.add_option("--momentum", f.momentum, "sgd, rmsprop: momentum")->capture_default_str();
  app.add_option("--weight-decay", f.weight_decay, "weight decay: 0 <= D < 1 (default: adamw 0.01, others 0)");
  app.add_flag("--large-weight-decay", f.large_weight_decay,
               "accept --weight-decay of 1 or more (rarely meant: a slip of the decimal point decays every weight away)");
  app.add_option("--betas", f.betas, "adam, adamw: B1,B2")->capture_default_str();
  app.add_option("--optimizer-state", f.optimizer_state,
                 std::string("adam, adamw: fp32 | 8bit (blockwise 8-bit moments, ~1/4 of the bytes)") +
                     (planned ? " | auto (8bit only where it lets a faster plan fit, or any plan)" : ""))
      ->capture_default_str();
  if (!planned) return;
  app.add_option("--profile-cache", f.profile_cache,
                 "keep the planner's measurements in this directory for the next run of the same job, or none "
                 "(default: $MEMFIT_CACHE_DIR, $XDG_CACHE_HOME/memfit or ~/.cache/memfit)");
  app.add_flag("--replan", f.replan, "measure the model again even when the profile cache holds its measurements");
}

ProfileCacheOptions profile_cache_options(const StepFlags& f) {
  ProfileCacheOptions o;
  o.dir = f.profile_cache.empty() ? default_profile_cache_dir() : (f.profile_cache == "none" ? "" : f.profile_cache);
  o.replan = f.replan;
  return o;
}

Workload build_workload(WorkloadFlags& f) {
  check_option(f.threads >= 0 && f.threads <= 1024, "threads", f.threads, "expected 1 to 1024 (0: all cores)");
  at::set_num_threads(f.threads > 0 ? f.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  // Every shape given must be valid, also those of another model than the one chosen.
  const std::pair<const char*, int64_t> shapes[] = {{"gpt.d_model", f.model.gpt.d_model}, {"gpt.heads", f.model.gpt.heads},
                                                    {"gpt.seq", f.model.gpt.seq},         {"cnn.blocks", f.model.cnn.blocks},
                                                    {"cnn.channels", f.model.cnn.channels}, {"mlp.width", f.model.mlp.width}};
  for (const auto& [name, value] : shapes) check_option(value >= 1, name, value, "expected a positive integer");
  if (f.layers) check_option(*f.layers >= 1, "gpt.layers", *f.layers, "expected a positive integer");
  const std::string& model = f.model.model;
  if (model == "gpt" || model == "cnn" || model == "mlp") {
    if (f.layers) f.model.gpt.layers = f.model.mlp.layers = *f.layers;
    return make_workload(f.model);
  }
  check_option(std::filesystem::is_regular_file(model), "model", "'" + model + "'",
               "expected gpt, cnn, mlp or a TorchScript file");
  ScriptWorkloadOptions o;
  o.model_file = model;
  o.data_file = f.model.data_file;
  o.loss = parse_loss_kind(f.loss);
  o.seed = f.model.seed;
  return load_script_workload(o);
}

c10::Device parse_device(const std::string& text) {
  try {
    const c10::Device device(text);
    if ((device.is_cpu() && (!device.has_index() || device.index() == 0)) || device.is_cuda()) return device;
  } catch (const c10::Error&) {
  }
  throw OptionError("device", "'" + text + "'", "expected cpu, cuda or cuda:N");
}

OptimizerSpec optimizer_spec(const StepFlags& f) {
  // The library takes any finite decay >= 0 (a C++ caller who writes 5 means it); from the
  // command line 1 or more is far likelier a typo, and accepted only when asked for.
  if (f.weight_decay && !f.large_weight_decay) {
    check_option(*f.weight_decay < 1, "optimizer.weight_decay", number_text(*f.weight_decay),
                 "expected 0 <= weight decay < 1 (--large-weight-decay accepts 1 or more)");
  }
  OptimizerSpec s;
  s.family = parse_optimizer_family(f.optimizer);
  s.lr = f.lr;
  s.momentum = f.momentum;
  s.weight_decay = f.weight_decay;
  char comma = 0;
  std::istringstream in(f.betas);
  if (!(in >> s.beta1 >> comma >> s.beta2) || comma != ',' || !in.eof()) {
    throw OptionError("optimizer.betas", "'" + f.betas + "'", "expected B1,B2 like 0.9,0.999");
  }
  s.state = parse_state_precision(f.optimizer_state);
  check_optimizer_spec(s);
  return s;
}

std::optional<CheckpointPlan> pinned_checkpoint(const std::string& spec, int blocks) {
  if (spec == "auto") return std::nullopt;
  return CheckpointPlan::parse(spec, blocks);
}

StepConfig step_config(const StepFlags& f, int blocks) {
  StepConfig c;
  c.device = parse_device(f.device);
  c.batch = f.batch;
  c.micro_batch = f.micro_batch;
  c.set_to_none = !f.keep_grads;
  c.optimizer = optimizer_spec(f);
  if (f.precision != "auto") c.precision = parse_precision(f.precision);
  c.checkpoint = pinned_checkpoint(f.checkpoint, blocks).value_or(CheckpointPlan::none());
  check_step_config(c, blocks);
  return c;
}

namespace {

// Library option names (errors.h) and the flags that set them.
const std::map<std::string, std::string>& flag_names() {
  static const std::map<std::string, std::string> flags = {
      {"batch", "--batch"}, {"micro_batch", "--micro-batch"}, {"precision", "--precision"},
      {"checkpoint", "--checkpoint"}, {"steps", "--steps"}, {"budget", "--budget"}, {"device", "--device"},
      {"threads", "--threads"}, {"model", "--model"}, {"optimizer", "--optimizer"}, {"optimizer.lr", "--lr"},
      {"optimizer.momentum", "--momentum"}, {"optimizer.weight_decay", "--weight-decay"}, {"optimizer.betas", "--betas"},
      {"optimizer.state", "--optimizer-state"},
      {"gpt.layers", "--layers"}, {"mlp.layers", "--layers"}, {"gpt.d_model", "--d-model"}, {"gpt.heads", "--heads"},
      {"gpt.seq", "--seq"}, {"gpt.shortest", "--shortest"}, {"gpt.dropout", "--dropout"}, {"gpt.vocab", "--data"}, {"cnn.blocks", "--blocks"},
      {"cnn.channels", "--channels"}, {"mlp.width", "--width"}, {"world_size", "--world-size"}, {"zero_stage", "--zero"}, {"prefetch_depth", "--prefetch-depth"},
      {"offload", "--offload"}, {"host_budget", "--host-budget"},
      {"distributed.world_size", "--world-size"}, {"distributed.rank", "--rank"}, {"distributed.master", "--master"},
      {"distributed.timeout", "--dist-timeout"}, {"save_every", "--save-every"}, {"eval_every", "--eval-every"}, {"progress_every", "--progress-every"},
      {"eval_batches", "--eval-batches"}, {"inject_oom", "--inject-oom"}, {"json_log", "--json-log"},
      {"dump_weights", "--dump-weights"}, {"data", "--data"}, {"loss", "--loss"}, {"save_dir", "--save"},
      {"resume_dir", "--resume"}, {"report_html", "--report"}, {"profile_cache", "--profile-cache"},
      {"verify_steps", "--verify-steps"}};
  return flags;
}

}  // namespace

std::string flag_message(const OptionError& e) {
  const auto& flags = flag_names();
  const auto it = flags.find(e.option());
  if (it == flags.end()) return e.what();
  return "invalid " + it->second + " " + e.value() + ": " + e.expected();
}

std::string in_flag_terms(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const size_t open = text.find('`', i), close = open == std::string::npos ? open : text.find('`', open + 1);
    if (close == std::string::npos) {
      out += text.substr(i);
      break;
    }
    const auto it = flag_names().find(text.substr(open + 1, close - open - 1));
    out += text.substr(i, open - i) + (it != flag_names().end() ? it->second : text.substr(open, close - open + 1));
    i = close + 1;
  }
  return out;
}

}  // namespace memfit::cli
