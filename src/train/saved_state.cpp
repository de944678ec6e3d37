#include "memfit/train/saved_state.h"

#include <fcntl.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>
#include <stdexcept>
#include <unordered_set>

#include "memfit/techniques/rng.h"
#include "runtime/json_fields.h"

namespace fs = std::filesystem;

namespace memfit {
namespace {

constexpr const char* kManifest = "state.json";
constexpr int kFormat = 3;  // 2: one file holding everything (memfit before ZeRO 3 saved by parts)

std::string read_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) throw std::runtime_error("cannot resume: " + path.string() + " is not a file");
  std::ifstream in(path, std::ios::binary);
  std::string bytes;
  try {
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::exception&) {
    in.setstate(std::ios::badbit);
  }
  if (!in && !in.eof()) throw std::runtime_error("cannot resume: cannot read " + path.string());
  return bytes;
}

void fsync_path(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Testing the commit protocol: a process whose MEMFIT_CRASH_POINT names a point of a save
// ("STEP:FILE:written", the temporary complete; "STEP:FILE:renamed", in place) dies there by
// SIGKILL, as a machine losing power would, so that a test can visit every point in turn.
void crash_point(int64_t step, const fs::path& file, const char* moment) {
  static const char* const target = std::getenv("MEMFIT_CRASH_POINT");
  if (target != nullptr && std::to_string(step) + ":" + file.filename().string() + ":" + moment == target) ::raise(SIGKILL);
}

// `write` fills PATH.tmp<pid>; it is flushed to disk and renamed to PATH, and the directory
// entry flushed: PATH is then either the old file or the whole new one. Returns the manifest
// entry of the new file (its name, size and sha256).
// `step`: the save's (crash points name it).
nlohmann::json write_atomically(const fs::path& path, int64_t step, const std::function<void(const fs::path& tmp)>& write) {
  const fs::path tmp = path.string() + ".tmp" + std::to_string(::getpid());
  try {
    write(tmp);
  } catch (const std::exception& e) {
    std::error_code ec;
    fs::remove(tmp, ec);
    const std::string what = e.what();
    throw std::runtime_error("cannot save state: writing " + tmp.string() + " failed (" + what.substr(0, what.find('\n')) + ")");
  }
  fsync_path(tmp, O_RDONLY);
  const nlohmann::json entry{{"name", path.filename().string()},
                             {"bytes", static_cast<int64_t>(fs::file_size(tmp))},
                             {"sha256", sha256_file(tmp.string())}};
  crash_point(step, path, "written");
  fs::rename(tmp, path);
  fsync_path(path.parent_path(), O_RDONLY | O_DIRECTORY);
  crash_point(step, path, "renamed");
  return entry;
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.flush();
  if (!out) throw std::runtime_error("the disk refused the bytes");
}

std::string step_digits(int64_t step) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%08lld", static_cast<long long>(step));
  return digits;
}
std::string head_name(const std::string& digits) { return "state-" + digits + ".json"; }
std::string part_name(const std::string& digits, size_t k) {
  char index[32];
  std::snprintf(index, sizeof index, "%04zu", k);
  return "state-" + digits + ".part-" + index + ".pt";
}

// A tensor as a part stores it: a view into a storage much larger than the whole part (a
// parameter carved from one big buffer) is copied, so that each part's file holds about its
// own bytes (a view into one gathered ZeRO 3 block is not: that storage is the part).
at::Tensor stored(const at::Tensor& t, int64_t part_bytes) {
  const at::Tensor d = t.detach();
  const bool foreign = static_cast<int64_t>(d.storage().nbytes()) > 2 * part_bytes + 4096;
  return foreign ? d.clone() : d;
}

int64_t part_bytes(const StatePart& part) {
  int64_t bytes = 0;
  for (const auto& p : part.parameters) bytes += static_cast<int64_t>(p.nbytes());
  for (const auto& s : part.parameter_state) {
    if (!s) continue;
    for (const auto& t : s->tensors) bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  }
  for (const auto& b : part.buffers) bytes += static_cast<int64_t>(b.nbytes());
  return bytes;
}

// One part's archive: "p<i>" parameters, "s<i>_<j>" state slot j of parameter i, "b<i>"
// buffers, and "index" (JSON: the names, each parameter's step and which slots it has).
void write_part_archive(const StatePart& part, const fs::path& path) {
  torch::serialize::OutputArchive archive;
  const int64_t bytes = part_bytes(part);
  nlohmann::json state = nlohmann::json::array();
  for (size_t i = 0; i < part.parameters.size(); ++i) {
    archive.write("p" + std::to_string(i), stored(part.parameters[i], bytes));
    const auto& record = part.parameter_state.at(i);
    if (!record) {
      state.push_back(nullptr);
      continue;
    }
    std::vector<bool> slots;
    for (size_t j = 0; j < record->tensors.size(); ++j) {
      slots.push_back(record->tensors[j].defined());
      if (slots.back()) archive.write("s" + std::to_string(i) + "_" + std::to_string(j), stored(record->tensors[j], bytes));
    }
    state.push_back({{"step", record->step}, {"slots", slots}});
  }
  for (size_t i = 0; i < part.buffers.size(); ++i) archive.write("b" + std::to_string(i), stored(part.buffers[i], bytes), true);
  const nlohmann::json index{{"parameters", part.parameter_names}, {"buffers", part.buffer_names}, {"state", state}};
  archive.write("index", c10::IValue(index.dump()));
  archive.save_to(path.string());
}

// A generator's state (bytes) as hex, and back (one line naming what is wrong).
std::string to_hex(const at::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  const at::Tensor b = bytes.to(c10::kCPU).contiguous();
  const auto* p = b.data_ptr<uint8_t>();
  std::string out;
  for (int64_t i = 0; i < b.numel(); ++i) out += {digits[p[i] >> 4], digits[p[i] & 15]};
  return out;
}
at::Tensor from_hex(const std::string& text) {
  if (text.size() % 2 != 0 || text.find_first_not_of("0123456789abcdef") != std::string::npos) {
    throw std::invalid_argument("a generator state that is not lowercase hex of whole bytes");
  }
  at::Tensor b = at::empty({static_cast<int64_t>(text.size() / 2)}, at::kByte);
  auto* p = b.data_ptr<uint8_t>();
  for (size_t i = 0; i < text.size(); i += 2) p[i / 2] = static_cast<uint8_t>(std::stoi(text.substr(i, 2), nullptr, 16));
  return b;
}

// The head is JSON (no tensor in it: only the parts go through LibTorch's archive reader).
std::string head_json(const nlohmann::json& meta, const OptimizerSpec& spec, size_t parts, c10::Device device) {
  const RngState rng = capture_rng(device);
  return nlohmann::json{{"meta", meta},
                        {"parts", parts},  // what the manifest must name
                        {"optimizer", optimizer_spec_json(spec)},
                        {"rng_cpu", to_hex(rng.cpu)},
                        {"rng_cuda", rng.cuda.defined() ? nlohmann::json(to_hex(rng.cuda)) : nlohmann::json()}}
             .dump(1) + "\n";
}

std::vector<std::string> names_of(const nlohmann::json& index, const char* key) {
  std::vector<std::string> names;
  for (const auto& n : json_fields::array(index, key)) {
    if (!n.is_string()) throw std::invalid_argument("a name that is not text");
    names.push_back(n.get<std::string>());
  }
  return names;
}

std::optional<ParamStateRecord> read_record(torch::serialize::InputArchive& archive, const nlohmann::json& entry, size_t i) {
  if (entry.is_null()) return std::nullopt;
  ParamStateRecord record;
  record.step = json_fields::integer(entry, "step");
  const auto& slots = json_fields::array(entry, "slots");
  for (size_t j = 0; j < slots.size(); ++j) {
    if (!slots[j].is_boolean()) throw std::invalid_argument("a slot flag that is not true or false");
    at::Tensor t;
    if (slots[j].get<bool>()) archive.read("s" + std::to_string(i) + "_" + std::to_string(j), t);
    record.tensors.push_back(t);
  }
  return record;
}

StatePart parse_part(const std::string& bytes) {
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  c10::IValue index_text;
  if (!archive.try_read("index", index_text) || !index_text.isString()) throw std::invalid_argument("no index record");
  const nlohmann::json index = nlohmann::json::parse(index_text.toStringRef());
  StatePart part;
  part.parameter_names = names_of(index, "parameters");
  part.buffer_names = names_of(index, "buffers");
  const auto& state = json_fields::array(index, "state", static_cast<int>(part.parameter_names.size()));
  for (size_t i = 0; i < part.parameter_names.size(); ++i) {
    at::Tensor p;
    archive.read("p" + std::to_string(i), p);
    part.parameters.push_back(p);
    part.parameter_state.push_back(read_record(archive, state[i], i));
  }
  for (size_t i = 0; i < part.buffer_names.size(); ++i) {
    at::Tensor b;
    archive.read("b" + std::to_string(i), b, true);
    part.buffers.push_back(b);
  }
  return part;
}

// The manifest's file names, checked: "state-<digits>.json" then "state-<digits>.part-<k>.pt" for
// k = 0, 1, ... (plain file names in DIR).
std::vector<fs::path> manifest_files(const fs::path& dir, const nlohmann::json& manifest) {
  const auto& files = json_fields::array(manifest, "files");
  if (files.empty()) json_fields::refuse("files", files, "expected one file at least");
  const std::string head = json_fields::text(files[0], "name");
  const bool digits = head.size() > 11 && head.find_first_not_of("0123456789", 6) == head.size() - 5;
  if (head.rfind("state-", 0) != 0 || head.compare(head.size() - 5, 5, ".json") != 0 || !digits) {
    throw std::runtime_error("names a file that is not a state file: " + nlohmann::json(head).dump());
  }
  const std::string step = head.substr(6, head.size() - 11);
  std::vector<fs::path> paths{dir / head};
  for (size_t k = 1; k < files.size(); ++k) {
    const std::string name = json_fields::text(files[k], "name");
    if (name != part_name(step, k - 1)) {
      throw std::runtime_error("file " + std::to_string(k) + " is " + nlohmann::json(name).dump() + ", expected " +
                               part_name(step, k - 1));
    }
    paths.push_back(dir / name);
  }
  return paths;
}

nlohmann::json read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifest;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    const bool old_format = fs::exists(dir / "state.pt");
    throw std::runtime_error("cannot resume: no saved state in '" + dir.string() + "' (expected " + path.string() +
                             (old_format ? "; state.pt there was written by an older memfit without a manifest)" : ")"));
  }
  try {
    nlohmann::json manifest = nlohmann::json::parse(read_file(path));
    const int64_t format = json_fields::integer(manifest, "format");
    if (format == 2) throw std::runtime_error("format 2, written by an older memfit in one file; this memfit reads format 3");
    if (format != kFormat) throw std::runtime_error("format " + manifest["format"].dump() + ", expected 3");
    manifest_files(dir, manifest);
    for (const auto& entry : manifest["files"]) {
      json_fields::integer(entry, "bytes");
      if (json_fields::text(entry, "sha256").size() != 64) throw std::runtime_error("a sha256 of 64 hex digits expected");
    }
    return manifest;
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw std::runtime_error("cannot resume: corrupt manifest " + path.string() + " (" + what.substr(0, what.find('\n')) + ")");
  }
}

std::string mismatch(const std::string& where, const std::string& what) {
  return "cannot resume: " + where + " holds another model or optimizer than this run's (" + what + ")";
}

void check_tensors_fit(const std::vector<std::string>& saved_names, const std::vector<at::Tensor>& saved,
                       const std::vector<std::string>& live_names, const std::vector<at::Tensor>& live, const std::string& where) {
  if (saved_names != live_names) throw std::runtime_error(mismatch(where, "other tensor names"));
  for (size_t i = 0; i < saved.size(); ++i) {
    if (!saved[i].defined() || saved[i].sizes() != live[i].sizes() || saved[i].scalar_type() != live[i].scalar_type()) {
      throw std::runtime_error(mismatch(where, live_names[i] + ": another shape or dtype"));
    }
  }
}

// Each saved parameter's state has the slots `spec` keeps, each of the shape and dtype it has
// for that parameter.
void check_state_fits(const StatePart& saved, const StatePart& live, const OptimizerSpec& spec, const std::string& where) {
  for (size_t i = 0; i < saved.parameter_state.size(); ++i) {
    const auto& record = saved.parameter_state[i];
    if (!record) continue;
    if (record->tensors.size() != param_state_slots(spec)) throw std::runtime_error(mismatch(where, "another optimizer family"));
    for (size_t j = 0; j < record->tensors.size(); ++j) {
      const at::Tensor& t = record->tensors[j];
      if (!t.defined()) continue;
      const at::Tensor& p = live.parameters[i];
      const at::Tensor expected = empty_param_state_slot(spec, j, at::empty(p.sizes(), p.options().device(c10::kMeta)));
      if (t.sizes() != expected.sizes() || t.scalar_type() != expected.scalar_type()) {
        throw std::runtime_error(mismatch(where, live.parameter_names[i] + "'s optimizer state: another shape or dtype"));
      }
    }
  }
}

}  // namespace

// --- parts ---------------------------------------------------------------------------------------

std::vector<StatePart> state_parts(const torch::nn::Module& model) {
  std::unordered_set<const c10::TensorImpl*> seen;
  auto add = [&](StatePart& part, const std::string& prefix, const torch::nn::Module& m, bool recurse) {
    for (const auto& p : m.named_parameters(recurse)) {
      if (!seen.insert(p.value().unsafeGetTensorImpl()).second) continue;
      part.parameter_names.push_back(prefix + p.key());
      part.parameters.push_back(p.value());
      part.parameter_state.emplace_back();
    }
    for (const auto& b : m.named_buffers(recurse)) {
      if (!seen.insert(b.value().unsafeGetTensorImpl()).second) continue;
      part.buffer_names.push_back(prefix + b.key());
      part.buffers.push_back(b.value());
    }
  };
  std::vector<StatePart> parts;
  StatePart own;
  add(own, "", model, false);
  if (!own.parameters.empty() || !own.buffers.empty()) parts.push_back(std::move(own));
  for (const auto& child : model.named_children()) {
    parts.emplace_back();
    add(parts.back(), child.key() + ".", *child.value(), true);
  }
  return parts;
}

void read_optimizer_state(StatePart& part, const torch::optim::Optimizer& optimizer) {
  for (size_t i = 0; i < part.parameters.size(); ++i) {
    const auto it = optimizer.state().find(param_state_key(part.parameters[i]));
    part.parameter_state[i] = it == optimizer.state().end() ? std::nullopt : std::optional(read_param_state(*it->second));
  }
}

void put_parameter_state(StatePart& part, const std::vector<at::Tensor>& parameters, const ParameterStates& state) {
  for (size_t i = 0; i < part.parameters.size(); ++i) {
    part.parameter_state[i].reset();
    for (size_t j = 0; j < parameters.size() && j < state.size(); ++j) {
      if (parameters[j].is_same(part.parameters[i])) part.parameter_state[i] = state[j];
    }
  }
}

ParameterStates parameter_state_of(const StatePart& part, const std::vector<at::Tensor>& parameters) {
  ParameterStates state(parameters.size());
  for (size_t j = 0; j < parameters.size(); ++j) {
    for (size_t i = 0; i < part.parameters.size(); ++i) {
      if (parameters[j].is_same(part.parameters[i])) state[j] = part.parameter_state[i];
    }
  }
  return state;
}

void check_part_fits(const StatePart& saved, const StatePart& live, const OptimizerSpec& spec, const std::string& where) {
  check_tensors_fit(saved.parameter_names, saved.parameters, live.parameter_names, live.parameters, where);
  check_tensors_fit(saved.buffer_names, saved.buffers, live.buffer_names, live.buffers, where);
  check_state_fits(saved, live, spec, where);
}

void copy_part_tensors(const StatePart& saved, const StatePart& live) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < live.parameters.size(); ++i) live.parameters[i].detach().copy_(saved.parameters[i]);
  for (size_t i = 0; i < live.buffers.size(); ++i) live.buffers[i].detach().copy_(saved.buffers[i]);
}

// --- writing -------------------------------------------------------------------------------------

StateWriter::StateWriter(fs::path dir, int64_t step) : dir_(std::move(dir)), step_(step) { fs::create_directories(dir_); }

void StateWriter::write_part(const StatePart& part) {
  const fs::path path = dir_ / part_name(step_digits(step_), files_.size());
  files_.push_back(write_atomically(path, step_, [&](const fs::path& tmp) { write_part_archive(part, tmp); }));
}

void StateWriter::commit(const nlohmann::json& meta, const OptimizerSpec& spec, c10::Device device) {
  const fs::path head = dir_ / head_name(step_digits(step_));
  const std::string head_bytes = head_json(meta, spec, files_.size(), device);
  nlohmann::json files = nlohmann::json::array({write_atomically(head, step_, [&](const fs::path& tmp) { write_bytes(tmp, head_bytes); })});
  for (const auto& f : files_) files.push_back(f);
  const std::string manifest = nlohmann::json{{"format", kFormat}, {"files", files}}.dump(2) + "\n";
  write_atomically(dir_ / kManifest, step_, [&](const fs::path& tmp) { write_bytes(tmp, manifest); });  // the commit point
  remove_stale_state_files(dir_);
}

void save_state(const fs::path& dir, const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                const OptimizerSpec& spec, const nlohmann::json& meta, c10::Device device) {
  StateWriter writer(dir, meta.at("step").get<int64_t>());
  for (StatePart& part : state_parts(model)) {
    read_optimizer_state(part, optimizer);
    writer.write_part(part);
  }
  writer.commit(meta, spec, device);
}

int remove_stale_state_files(const fs::path& dir) {
  std::set<std::string> keep;
  try {
    for (const auto& path : manifest_files(dir, read_manifest(dir))) keep.insert(path.filename().string());
  } catch (const std::exception&) {
    // No valid manifest: only temporaries are surely stale.
  }
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool temporary = name.find(".tmp") != std::string::npos && (name.rfind("state", 0) == 0);
    const auto ends_with = [&name](const std::string& end) {
      return name.size() > end.size() && name.compare(name.size() - end.size(), end.size(), end) == 0;
    };
    const bool superseded = !keep.empty() && name.rfind("state-", 0) == 0 && keep.count(name) == 0 &&
                            (ends_with(".pt") || ends_with(".json"));
    if ((temporary || superseded) && fs::remove(entry.path(), ec)) ++removed;
  }
  return removed;
}

// --- reading -------------------------------------------------------------------------------------

SavedState SavedState::open(const fs::path& dir) {
  const nlohmann::json manifest = read_manifest(dir);
  const std::vector<fs::path> paths = manifest_files(dir, manifest);
  SavedState s;
  for (size_t k = 0; k < paths.size(); ++k) {
    const auto& entry = manifest["files"][k];
    File f{paths[k], entry["bytes"].get<int64_t>(), entry["sha256"].get<std::string>()};
    std::error_code ec;
    if (!fs::is_regular_file(f.path, ec)) throw std::runtime_error("cannot resume: " + f.path.string() + ", named in state.json, is missing");
    if (static_cast<int64_t>(fs::file_size(f.path, ec)) != f.bytes || ec || sha256_file(f.path.string()) != f.sha256) {
      throw std::runtime_error("cannot resume: " + f.path.string() + " is corrupt or truncated (its size or sha256 differs from state.json)");
    }
    if (k == 0) {
      s.head_file_ = f;
    } else {
      s.parts_.push_back(f);
    }
  }
  s.head_ = s.head_file_.path;
  const std::string bytes = read_file(s.head_);
  if (sha256_hex(bytes) != s.head_file_.sha256) throw std::runtime_error("cannot resume: " + s.head_.string() + " changed while it was read");
  try {
    const nlohmann::json head = nlohmann::json::parse(bytes);
    s.meta_ = json_fields::field(head, "meta");
    json_fields::integer(s.meta_, "step");
    const int64_t parts = json_fields::integer(head, "parts");
    if (parts != s.parts()) {
      throw std::runtime_error("cannot resume: " + s.head_.string() + " was saved with " + std::to_string(parts) +
                               " parts, state.json names " + std::to_string(s.parts()));
    }
    s.rng_cpu_ = from_hex(json_fields::text(head, "rng_cpu"));
    const auto& cuda = json_fields::field(head, "rng_cuda");
    s.rng_cuda_ = cuda.is_null() ? at::Tensor() : from_hex(json_fields::text(head, "rng_cuda"));
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).rfind("cannot resume:", 0) == 0) throw;
    throw std::runtime_error("cannot resume: " + s.head_.string() + " matches its checksum but cannot be read by this memfit");
  } catch (const std::exception&) {
    // The bytes are the ones saved: a reader that cannot parse them is another memfit's.
    throw std::runtime_error("cannot resume: " + s.head_.string() + " matches its checksum but cannot be read by this memfit");
  }
  return s;
}

StatePart SavedState::read_part(int k) const {
  const File& f = parts_.at(static_cast<size_t>(k));
  const std::string bytes = read_file(f.path);
  if (static_cast<int64_t>(bytes.size()) != f.bytes || sha256_hex(bytes) != f.sha256) {
    throw std::runtime_error("cannot resume: " + f.path.string() + " changed since its checksum was verified");
  }
  try {
    return parse_part(bytes);
  } catch (const std::exception&) {
    throw std::runtime_error("cannot resume: " + f.path.string() + " matches its checksum but cannot be read by this memfit");
  }
}

void SavedState::load_into(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec,
                           c10::Device device) {
  const std::vector<StatePart> live = state_parts(model);
  if (static_cast<int>(live.size()) != parts()) {
    throw std::runtime_error(mismatch(head_.string(), std::to_string(parts()) + " parts saved, this model has " +
                                                          std::to_string(live.size())));
  }
  for (int k = 0; k < parts(); ++k) {
    const StatePart saved = read_part(k);
    const std::string where = parts_[static_cast<size_t>(k)].path.string();
    check_part_fits(saved, live[static_cast<size_t>(k)], spec, where);
    copy_part_tensors(saved, live[static_cast<size_t>(k)]);
    for (size_t i = 0; i < saved.parameters.size(); ++i) {
      const at::Tensor& p = live[static_cast<size_t>(k)].parameters[i];
      const auto& record = saved.parameter_state[i];
      if (!record) {
        optimizer.state().erase(param_state_key(p));
        continue;
      }
      ParamStateRecord on_device{record->step, {}};
      for (const auto& t : record->tensors) on_device.tensors.push_back(t.defined() ? t.to(p.device()) : t);
      optimizer.state()[param_state_key(p)] = make_param_state(spec, on_device);
    }
  }
  restore_generators(device);
}

void SavedState::restore_generators(c10::Device device) const {
  RngState rng = capture_rng(device);
  const bool fits = rng_cpu_.sizes() == rng.cpu.sizes() && (!rng.cuda.defined() || (rng_cuda_.defined() && rng_cuda_.sizes() == rng.cuda.sizes()));
  if (!fits) throw std::runtime_error("cannot resume: " + head_.string() + " holds random generators of another kind");
  rng.cpu = rng_cpu_;
  if (rng.cuda.defined()) rng.cuda = rng_cuda_;
  restore_rng(rng);
}

// --- weights' hash -------------------------------------------------------------------------------

std::string weights_sha256(const std::function<void(const ParameterVisitor&)>& visit_all) {
  Sha256 sha;
  visit_all([&](const at::Tensor& p) {
    const auto c = p.detach().to(c10::kCPU).contiguous();
    sha.add(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  });
  return sha.hex();
}

std::string weights_sha256(const torch::nn::Module& module) {
  return weights_sha256([&](const ParameterVisitor& visit) {
    for (const auto& p : module.parameters()) visit(p);
  });
}

nlohmann::json SavedMeta::to_json() const {
  return {{"version", kVersion},
          {"step", step},
          {"batch", batch},
          {"seed", seed},
          {"model", model},
          {"parameters", parameters},
          {"optimizer", optimizer_family_name(optimizer)},
          {"optimizer_state", state_precision_name(optimizer_state)},
          {"plan", plan}};
}

SavedMeta SavedMeta::from_json(const nlohmann::json& j) {
  namespace jf = json_fields;
  const int64_t version = jf::integer(j, "version");
  if (version != kVersion) {
    jf::refuse("version", version, "expected this memfit's " + std::to_string(kVersion));
  }
  SavedMeta m;
  m.step = jf::integer(j, "step");
  m.batch = jf::integer(j, "batch", 1);
  const auto& seed = jf::field(j, "seed");
  if (!seed.is_number_unsigned() && !(seed.is_number_integer() && seed.get<int64_t>() >= 0)) {
    jf::refuse("seed", seed, "expected a non-negative integer");
  }
  m.seed = seed.get<uint64_t>();
  m.model = jf::text(j, "model");
  m.parameters = jf::integer(j, "parameters");
  m.optimizer = parse_optimizer_family(jf::text(j, "optimizer"));
  m.optimizer_state = parse_state_precision(jf::text(j, "optimizer_state"));
  m.plan = jf::field(j, "plan");
  if (!m.plan.is_object()) jf::refuse("plan", m.plan, "expected an object");
  return m;
}

}  // namespace memfit
