#include "memfit/train/saved_state.h"

#include <fcntl.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "memfit/techniques/rng.h"
#include "runtime/json_fields.h"

namespace fs = std::filesystem;

namespace memfit {
namespace {

constexpr const char* kManifest = "state.json";

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

// Writes `bytes` to PATH.tmp<pid>, flushes it to disk, renames it to PATH, and flushes the
// directory entry: PATH is then either the old file or the whole new one.
void write_atomically(const fs::path& path, const std::string& bytes) {
  const fs::path tmp = path.string() + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw std::runtime_error("cannot save state: writing " + tmp.string() + " failed");
  }
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  fs::rename(tmp, path);
  const int dir_fd = ::open(path.parent_path().c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

std::string archive_bytes(const torch::nn::Module& model, torch::optim::Optimizer& optimizer, const nlohmann::json& meta,
                          c10::Device device) {
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
  model.save(model_archive);
  optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("meta", c10::IValue(meta.dump()));
  const RngState rng = capture_rng(device);
  archive.write("rng_cpu", rng.cpu);
  if (rng.cuda.defined()) archive.write("rng_cuda", rng.cuda);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

// The manifest's one file entry, checked: "state-<digits>.pt", a plain file name in DIR.
fs::path manifest_file(const fs::path& dir, const nlohmann::json& manifest) {
  const std::string name = json_fields::text(json_fields::array(manifest, "files", 1)[0], "name");
  const bool digits = name.size() > 9 && name.find_first_not_of("0123456789", 6) == name.size() - 3;
  if (name.rfind("state-", 0) != 0 || name.compare(name.size() - 3, 3, ".pt") != 0 || !digits) {
    throw std::runtime_error("names a file that is not a state file: " + nlohmann::json(name).dump());
  }
  return dir / name;
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
    if (json_fields::integer(manifest, "format") != 2) throw std::runtime_error("format " + manifest["format"].dump() + ", expected 2");
    manifest_file(dir, manifest);
    const auto& entry = manifest["files"][0];
    json_fields::integer(entry, "bytes");
    if (json_fields::text(entry, "sha256").size() != 64) throw std::runtime_error("a sha256 of 64 hex digits expected");
    return manifest;
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw std::runtime_error("cannot resume: corrupt manifest " + path.string() + " (" + what.substr(0, what.find('\n')) + ")");
  }
}

}  // namespace

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

void save_state(const fs::path& dir, const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                const nlohmann::json& meta, c10::Device device) {
  fs::create_directories(dir);
  const std::string bytes = archive_bytes(model, optimizer, meta, device);
  char name[64];
  std::snprintf(name, sizeof name, "state-%08lld.pt", static_cast<long long>(meta.at("step").get<int64_t>()));
  write_atomically(dir / name, bytes);
  const nlohmann::json manifest{
      {"format", 2},
      {"files", {{{"name", name}, {"bytes", static_cast<int64_t>(bytes.size())}, {"sha256", sha256_hex(bytes.data(), bytes.size())}}}}};
  write_atomically(dir / kManifest, manifest.dump(2) + "\n");  // the commit point
  remove_stale_state_files(dir);
}

int remove_stale_state_files(const fs::path& dir) {
  std::string keep;
  try {
    keep = manifest_file(dir, read_manifest(dir)).filename().string();
  } catch (const std::exception&) {
    // No valid manifest: only temporaries are surely stale.
  }
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool temporary = name.find(".tmp") != std::string::npos && (name.rfind("state", 0) == 0);
    const bool superseded = !keep.empty() && name.rfind("state-", 0) == 0 && name != keep &&
                            name.size() > 3 && name.compare(name.size() - 3, 3, ".pt") == 0;
    if ((temporary || superseded) && fs::remove(entry.path(), ec)) ++removed;
  }
  return removed;
}

SavedState SavedState::open(const fs::path& dir) {
  const nlohmann::json manifest = read_manifest(dir);
  const nlohmann::json& entry = manifest["files"][0];
  SavedState s;
  s.file_ = manifest_file(dir, manifest);
  std::error_code ec;
  if (!fs::is_regular_file(s.file_, ec)) {
    throw std::runtime_error("cannot resume: " + s.file_.string() + ", named in state.json, is missing");
  }
  const std::string bytes = read_file(s.file_);
  if (static_cast<int64_t>(bytes.size()) != entry["bytes"].get<int64_t>() ||
      sha256_hex(bytes.data(), bytes.size()) != entry["sha256"].get<std::string>()) {
    throw std::runtime_error("cannot resume: " + s.file_.string() +
                             " is corrupt or truncated (its size or sha256 differs from state.json)");
  }
  try {
    s.archive_ = std::make_shared<torch::serialize::InputArchive>();
    s.archive_->load_from(bytes.data(), bytes.size());
    c10::IValue meta;
    if (!s.archive_->try_read("meta", meta)) throw std::runtime_error("no meta record");
    s.meta_ = nlohmann::json::parse(meta.toStringRef());
  } catch (const std::exception&) {
    // The bytes are the ones saved: a reader that cannot parse them is another memfit's.
    throw std::runtime_error("cannot resume: " + s.file_.string() + " matches its checksum but cannot be read by this memfit");
  }
  return s;
}

void SavedState::load_into(torch::nn::Module& model, torch::optim::Optimizer& optimizer, c10::Device device) {
  try {
    torch::serialize::InputArchive model_archive, optimizer_archive;
    archive_->read("model", model_archive);
    archive_->read("optimizer", optimizer_archive);
    model.load(model_archive);
    optimizer.load(optimizer_archive);
    RngState rng = capture_rng(device);
    archive_->read("rng_cpu", rng.cpu);
    if (rng.cuda.defined()) archive_->read("rng_cuda", rng.cuda);
    restore_rng(rng);
  } catch (const c10::Error&) {
    throw std::runtime_error("cannot resume: " + file_.string() + " holds another model or optimizer than this run's");
  }
}

}  // namespace memfit
