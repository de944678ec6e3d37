#include "memfit/train/saved_state.h"

#include <openssl/evp.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <stdexcept>

#include "memfit/techniques/rng.h"

namespace fs = std::filesystem;

namespace memfit {
namespace {

void fsync_path(const fs::path& p) {
  FILE* f = std::fopen(p.c_str(), "rb");
  if (f == nullptr) return;
  ::fsync(fileno(f));
  std::fclose(f);
}

std::string first_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string what = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  return what.substr(0, what.find('\n'));
}

fs::path state_file(const fs::path& dir) {
  const fs::path file = dir / "state.pt";
  if (!fs::exists(file)) {
    throw std::runtime_error("cannot resume: no saved state in '" + dir.string() + "' (expected " + file.string() + ")");
  }
  return file;
}

torch::serialize::InputArchive open_archive(const fs::path& file) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(file.string());
  } catch (const std::exception& e) {
    throw std::runtime_error("cannot resume: corrupt or truncated state file " + file.string() + " (" + first_line(e) + ")");
  }
  return archive;
}

}  // namespace

void save_state(const fs::path& dir, const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                const nlohmann::json& meta, c10::Device device) {
  fs::create_directories(dir);
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
  model.save(model_archive);
  optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("meta", c10::IValue(meta.dump()));
  const RngState rng = capture_rng(device);
  archive.write("rng_cpu", rng.cpu);
  if (rng.cuda.defined()) archive.write("rng_cuda", rng.cuda);
  const fs::path tmp = dir / ("state.pt.tmp" + std::to_string(::getpid()));
  archive.save_to(tmp.string());
  fsync_path(tmp);
  fs::rename(tmp, dir / "state.pt");
}

nlohmann::json load_state_meta(const fs::path& dir) {
  const fs::path file = state_file(dir);
  torch::serialize::InputArchive archive = open_archive(file);
  try {
    c10::IValue meta;
    if (!archive.try_read("meta", meta)) throw std::runtime_error("no meta record");
    return nlohmann::json::parse(meta.toStringRef());
  } catch (const std::exception& e) {
    throw std::runtime_error("cannot resume: corrupt or truncated state file " + file.string() + " (" + first_line(e) + ")");
  }
}

void load_state(const fs::path& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer, c10::Device device) {
  const fs::path file = state_file(dir);
  torch::serialize::InputArchive archive = open_archive(file);
  try {
    torch::serialize::InputArchive model_archive, optimizer_archive;
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    model.load(model_archive);
    optimizer.load(optimizer_archive);
    RngState rng = capture_rng(device);
    archive.read("rng_cpu", rng.cpu);
    if (rng.cuda.defined()) archive.read("rng_cuda", rng.cuda);
    restore_rng(rng);
  } catch (const c10::Error& e) {
    throw std::runtime_error("cannot resume: state file " + file.string() + " does not match the model (" + first_line(e) + ")");
  }
}

std::string weights_sha256(const torch::nn::Module& module) {
  // OpenSSL 3's EVP interface (the SHA256_* functions are deprecated there).
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("sha256: cannot initialise OpenSSL's digest");
  }
  for (const auto& p : module.parameters()) {
    auto c = p.detach().to(c10::kCPU).contiguous();
    EVP_DigestUpdate(ctx.get(), c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &length);
  std::string hex;
  char two[3];
  for (unsigned int i = 0; i < length; ++i) {
    std::snprintf(two, sizeof two, "%02x", digest[i]);
    hex += two;
  }
  return hex;
}

}  // namespace memfit
