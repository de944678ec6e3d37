#include "memfit/plan/profile_cache.h"

#include <ATen/Parallel.h>
#include <torch/version.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "memfit/digest.h"
#include "runtime/json_fields.h"

namespace fs = std::filesystem;

namespace memfit {
namespace {

constexpr int kFormat = 7;  // of the files; another number is ignored as stale (1: three chain times; 2: no one-sample blocks; 3: one sample on the line from a batch of 4; 4: peaks without their moments; 5: blocks measured alone; 6: one sample the only size below small)

// The running program's sha256, computed once per process ("" where it cannot be read).
const std::string& program_sha256() {
  static std::once_flag once;
  static std::string digest;
  std::call_once(once, [] {
    try {
      digest = sha256_file("/proc/self/exe");
    } catch (const std::exception&) {
      digest.clear();
    }
  });
  return digest;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 1);
  }
  return "unknown";
}

nlohmann::json tensor_shape(const at::Tensor& t) {
  return {{"sizes", t.sizes().vec()}, {"dtype", std::string(c10::toString(t.scalar_type()))}};
}

nlohmann::json module_shapes(const torch::nn::Module& m) {
  nlohmann::json params = nlohmann::json::object(), buffers = nlohmann::json::object();
  for (const auto& p : m.named_parameters()) params[p.key()] = tensor_shape(p.value());
  for (const auto& b : m.named_buffers()) buffers[b.key()] = tensor_shape(b.value());
  return {{"type", m.name()}, {"parameters", params}, {"buffers", buffers}};
}

nlohmann::json model_key(const Workload& w) {
  nlohmann::json blocks = nlohmann::json::array();
  for (int i = 0; i < w.chain->size(); ++i) {
    const Block& b = w.chain->block(i);
    blocks.push_back({{"name", b.name}, {"module", module_shapes(*b.module)}});
  }
  return {{"description", w.description}, {"fingerprint", w.fingerprint}, {"blocks", blocks}};
}

std::string cache_file(const std::string& dir, const nlohmann::json& key) {
  return (fs::path(dir) / ("profile-" + sha256_hex(key.dump()) + ".json")).string();
}

// The costs a file holds for `key`; throws std::invalid_argument saying why it is unusable.
MeasuredCosts read_cache_file(const std::string& path, const nlohmann::json& key) {
  std::ifstream in(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument("it is not JSON (corrupt or truncated)");
  }
  if (!j.is_object() || j.value("format", 0) != kFormat) throw std::invalid_argument("another format");
  if (j.value("key", nlohmann::json()) != key) throw std::invalid_argument("its key differs (stale)");
  return measured_costs_from_json(json_fields::field(j, "costs"));
}

// Written whole to a temporary file, then renamed over the old one.
void write_cache_file(const std::string& path, const nlohmann::json& key, const MeasuredCosts& costs) {
  fs::create_directories(fs::path(path).parent_path());
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream out(tmp);
    out << nlohmann::json{{"format", kFormat}, {"key", key}, {"costs", measured_costs_json(costs)}}.dump(1) << "\n";
    out.close();
    if (!out) throw std::runtime_error("cannot write " + tmp);
  }
  fs::rename(tmp, path);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

nlohmann::json measured_costs_json(const MeasuredCosts& costs) {
  nlohmann::json optimizer = nlohmann::json::array();
  for (const auto& c : costs.optimizer) optimizer.push_back(optimizer_cost_json(c));
  nlohmann::json j{{"profile", profile_json(costs.profile)}, {"optimizer", optimizer}};
  if (!costs.lengths.empty()) {
    nlohmann::json lengths = nlohmann::json::array();
    for (const auto& l : costs.lengths) lengths.push_back(length_profile_json(l));
    j["lengths"] = lengths;  // absent: none measured
  }
  return j;
}

MeasuredCosts measured_costs_from_json(const nlohmann::json& j) {
  MeasuredCosts costs;
  costs.profile = profile_from_json(json_fields::field(j, "profile"));
  for (const auto& c : json_fields::array(j, "optimizer")) costs.optimizer.push_back(optimizer_cost_from_json(c));
  if (costs.optimizer.empty()) json_fields::refuse("optimizer", j.at("optimizer"), "expected at least one optimizer cost");
  if (j.contains("lengths")) {
    const size_t blocks = costs.profile.precisions.front().small.blocks.size();
    for (const auto& l : json_fields::array(j, "lengths")) costs.lengths.push_back(length_profile_from_json(l, blocks));
  }
  return costs;
}

std::string default_profile_cache_dir() {
  if (const char* dir = std::getenv("MEMFIT_CACHE_DIR"); dir != nullptr && *dir != '\0') {
    return std::string(dir) == "none" ? "" : dir;
  }
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') return std::string(xdg) + "/memfit";
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') return std::string(home) + "/.cache/memfit";
  return "";
}

nlohmann::json profile_cache_key(const Workload& w, const Batch& batch, const std::vector<Precision>& precisions,
                                 const OptimizerSpec& optimizer, const std::vector<at::Tensor>& optimized) {
  nlohmann::json precision_names = nlohmann::json::array(), stepped = nlohmann::json::array();
  for (Precision p : precisions) precision_names.push_back(precision_name(p));
  for (const auto& p : optimized) stepped.push_back(tensor_shape(p));
  return {{"program", program_sha256()},
          {"memfit", MEMFIT_VERSION},
          {"libtorch", TORCH_VERSION},
          {"cpu", cpu_model()},
          {"cores", std::thread::hardware_concurrency()},
          {"threads", at::get_num_threads()},
          {"device", batch.input.device().str()},
          {"model", model_key(w)},
          {"batch", {{"input", tensor_shape(batch.input)}, {"target", tensor_shape(batch.target)}}},
          {"precisions", precision_names},
          {"optimizer", optimizer_spec_json(optimizer)},
          {"optimized", stepped}};
}

MeasuredCosts cached_costs(const ProfileCacheOptions& cache, const nlohmann::json& key,
                           const std::function<MeasuredCosts()>& measure, CostsSource& source) {
  const auto t0 = std::chrono::steady_clock::now();
  source = CostsSource{};
  source.key = key;
  if (!cache.dir.empty()) source.path = cache_file(cache.dir, key);
  if (!source.path.empty() && !cache.replan && fs::exists(source.path)) {
    try {
      MeasuredCosts costs = read_cache_file(source.path, key);
      source.cached = true;
      source.seconds = seconds_since(t0);
      return costs;
    } catch (const std::exception& e) {
      source.notes.push_back("profile cache " + source.path + " ignored: " + e.what() + "; measuring again");
    }
  }
  MeasuredCosts costs = measure();
  source.seconds = seconds_since(t0);
  store_costs(source, costs);
  return costs;
}

void store_costs(CostsSource& source, const MeasuredCosts& costs) {
  if (source.path.empty()) return;
  try {
    write_cache_file(source.path, source.key, costs);
  } catch (const std::exception& e) {
    source.notes.push_back(std::string("profile cache not written: ") + e.what());
  }
}

MeasuredCosts measure_costs(Workload& w, const Batch& batch, const std::vector<Precision>& precisions,
                            const OptimizerSpec& optimizer, const std::vector<at::Tensor>& optimized,
                            MemoryTracker& tracker, const ProfileCacheOptions& cache, CostsSource& source,
                            const ProfileOptions& options) {
  nlohmann::json key = profile_cache_key(w, batch, precisions, optimizer, optimized);
  key["streamed_backward"] = options.streamed;
  return cached_costs(cache, key, [&] {
    MeasuredCosts costs;
    costs.profile = profile_workload(w, batch, precisions, tracker, options);
    // Copies: a resumed run's state exists already and would be counted twice.
    std::vector<at::Tensor> copies;
    for (const auto& p : optimized) copies.push_back(p.detach().clone().requires_grad_(true));
    costs.optimizer = measure_optimizer_states(optimizer, copies, tracker);
    return costs;
  }, source);
}

}  // namespace memfit
