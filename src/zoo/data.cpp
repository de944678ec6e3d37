// Built-in data. Whole data sets live outside LibTorch's allocator (torch::from_blob over
// host buffers): they are host-side input, not training memory, so neither the budget nor the
// tracker counts them. Each batch is a fresh tensor and is counted.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "memfit/zoo/data.h"
#include "memfit/errors.h"

namespace fs = std::filesystem;

namespace memfit {
namespace {

// A tensor that views a host buffer it keeps alive.
template <class T>
at::Tensor host_tensor(std::vector<T> values, std::vector<int64_t> shape, at::ScalarType dtype) {
  auto owner = std::make_shared<std::vector<T>>(std::move(values));
  return torch::from_blob(owner->data(), shape, [owner](void*) mutable { owner.reset(); },
                          at::TensorOptions().dtype(dtype));
}

fs::path cache_dir() {
  if (const char* dir = std::getenv("MEMFIT_CACHE")) return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME")) return fs::path(xdg) / "memfit";
  if (const char* home = std::getenv("HOME")) return fs::path(home) / ".cache" / "memfit";
  return fs::temp_directory_path() / "memfit-cache";
}

std::vector<uint8_t> read_gz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw std::runtime_error("cannot open " + path);
  std::vector<uint8_t> out;
  std::array<uint8_t, 1 << 16> buf;
  int n;
  while ((n = gzread(f, buf.data(), buf.size())) > 0) out.insert(out.end(), buf.begin(), buf.begin() + n);
  const bool failed = n < 0;
  gzclose(f);
  if (failed) throw std::runtime_error("corrupt gzip file " + path);
  return out;
}

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

// IDX files: magic 0x0803 (images: n, rows, cols) or 0x0801 (labels: n), then uint8 data.
std::pair<std::vector<uint8_t>, std::vector<int64_t>> read_idx(const std::string& path) {
  std::vector<uint8_t> raw = read_gz(path);
  if (raw.size() < 8 || raw[0] != 0 || raw[1] != 0 || raw[2] != 8 || raw[3] < 1 || raw[3] > 3) {
    throw std::runtime_error("not an IDX uint8 file: " + path);
  }
  const int dims = raw[3];
  std::vector<int64_t> shape;
  size_t offset = 4, count = 1;
  for (int i = 0; i < dims; ++i, offset += 4) {
    shape.push_back(big_endian(&raw[offset]));
    count *= static_cast<size_t>(shape.back());
  }
  if (raw.size() != offset + count) throw std::runtime_error("truncated IDX file: " + path);
  return {std::vector<uint8_t>(raw.begin() + static_cast<long>(offset), raw.end()), shape};
}

}  // namespace

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read data file '" + path + "': no such readable file");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.size() < 1024) {
    throw std::runtime_error("data file '" + path + "' has " + std::to_string(text.size()) +
                             " bytes: expected at least 1024 characters of text");
  }
  return text;
}

std::string load_bible_text() {
  const fs::path path = cache_dir() / "kjv.txt";
  if (fs::exists(path)) return read_text_file(path.string());

  FILE* pipe = popen("bible -f gen1:1-rev22:21 2>/dev/null", "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run the bible reader");
  std::string raw;
  std::array<char, 1 << 16> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) raw.append(buf.data(), n);
  const int status = pclose(pipe);
  if (status != 0 || raw.size() < 1000000) {
    throw std::runtime_error(
        "cannot read the King James Bible: install Debian's bible-kjv and bible-kjv-text "
        "(bash scripts/setup.sh does), or give `data` a text file of your own");
  }
  // Lines look like "Ge1:1 In the beginning ...": keep the verse text only.
  std::string text;
  text.reserve(raw.size());
  std::istringstream lines(raw);
  std::string line;
  while (std::getline(lines, line)) {
    const auto space = line.find(' ');
    if (space == std::string::npos) continue;
    text.append(line, space + 1, std::string::npos);
    text.push_back('\n');
  }
  // Written atomically: a temporary file, then a rename.
  fs::create_directories(path.parent_path());
  const fs::path tmp = path.string() + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary);
    out << text;
    out.flush();
    if (!out) throw std::runtime_error("cannot write cache file " + tmp.string());
  }
  fs::rename(tmp, path);
  return text;
}

// Debian's dataset-fashion-mnist, unless MEMFIT_FASHION_MNIST_DIR names another folder of the
// same four .gz files (a machine without the package: bench/gpu_check.sh writes stand-ins).
std::string default_fashion_mnist_dir() {
  const char* dir = std::getenv("MEMFIT_FASHION_MNIST_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/usr/share/datasets/fashion-mnist";
}

TextDataset::TextDataset(const std::string& text, int64_t seq, std::string source, int64_t shortest)
    : source_(std::move(source)), seq_(seq), shortest_(shortest) {
  check_option(seq >= 1, "gpt.seq", seq, "expected a positive integer");
  check_option(shortest >= 0 && shortest <= seq, "gpt.shortest", shortest,
               "expected 0 (every batch seq long) or 1 to seq (" + std::to_string(seq) + ")");
  std::array<bool, 256> seen{};
  for (unsigned char ch : text) seen[ch] = true;
  for (int ch = 0; ch < 256; ++ch) {
    if (seen[static_cast<size_t>(ch)]) vocab_.push_back(static_cast<char>(ch));
  }
  std::array<uint8_t, 256> id{};
  for (size_t i = 0; i < vocab_.size(); ++i) id[static_cast<unsigned char>(vocab_[i])] = static_cast<uint8_t>(i);
  const size_t n = text.size();
  const size_t split = n - n / 10;
  if (static_cast<int64_t>(n / 10) < 4 * (seq + 1)) {
    throw OptionError("gpt.seq", std::to_string(seq), "a text of " + std::to_string(n) +
                      " characters is too short: its held-out 10% needs 4 windows of seq + 1");
  }
  std::vector<uint8_t> train(split), eval(n - split);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t t = id[static_cast<unsigned char>(text[i])];
    if (i < split) train[i] = t; else eval[i - split] = t;
  }
  train_ = host_tensor(std::move(train), {static_cast<int64_t>(split)}, at::kByte);
  eval_ = host_tensor(std::move(eval), {static_cast<int64_t>(n - split)}, at::kByte);
}

std::string TextDataset::describe() const {
  const std::string lengths = shortest_ > 0 && shortest_ < seq_
                                  ? ", batches of " + std::to_string(shortest_) + " to " + std::to_string(seq_) + " characters"
                                  : "";
  return source_ + ", " + std::to_string(train_.numel() + eval_.numel()) + " characters, vocabulary " +
         std::to_string(vocab_.size()) + lengths;
}

Batch TextDataset::windows(const at::Tensor& tokens, const at::Tensor& starts) const {
  // [B, T + 1] windows, input = first T, target = last T.
  auto offsets = starts.unsqueeze(1) + torch::arange(seq_ + 1, starts.options());
  auto w = tokens.index({offsets}).to(at::kLong);
  return {w.narrow(1, 0, seq_).contiguous(), w.narrow(1, 1, seq_).contiguous()};
}

Batch TextDataset::random_windows(at::Generator& gen, int64_t batch_size) const {
  auto starts = at::randint(0, train_.numel() - seq_ - 1, {batch_size}, gen, at::TensorOptions().dtype(at::kLong));
  return windows(train_, starts);
}

Batch TextDataset::train_batch(int64_t index, int64_t batch_size, uint64_t seed) const {
  auto gen = batch_generator(seed, index);
  const Batch batch = random_windows(gen, batch_size);
  if (shortest_ == 0 || shortest_ == seq_) return batch;
  const int64_t length = at::randint(shortest_, seq_ + 1, {1}, gen, at::TensorOptions().dtype(at::kLong)).item<int64_t>();
  const Batch cut = batch.cut(length);
  return {cut.input.contiguous(), cut.target.contiguous()};
}

Batch TextDataset::plan_batch(int64_t index, int64_t batch_size, uint64_t seed) const {
  auto gen = batch_generator(seed, index);
  return random_windows(gen, batch_size);  // training batch `index` before its cut: seq long
}

int64_t TextDataset::eval_batch_count(int64_t batch_size) const {
  return (eval_.numel() - 1) / seq_ / batch_size;
}

Batch TextDataset::eval_batch(int64_t index, int64_t batch_size) const {
  auto starts = (torch::arange(batch_size, at::TensorOptions().dtype(at::kLong)) + index * batch_size) * seq_;
  return windows(eval_, starts);
}

std::string TextDataset::decode(const at::Tensor& tokens) const {
  auto t = tokens.to(at::kLong).contiguous();
  std::string out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(vocab_.at(static_cast<size_t>(t.data_ptr<int64_t>()[i])));
  return out;
}

FashionMnistDataset::FashionMnistDataset(const std::string& directory) : directory_(directory) {
  auto load = [&](const char* images_name, const char* labels_name, at::Tensor& images, at::Tensor& labels) {
    const std::string ip = directory + "/" + images_name, lp = directory + "/" + labels_name;
    if (!fs::exists(ip) || !fs::exists(lp)) {
      throw std::runtime_error("Fashion-MNIST not found in '" + directory +
                               "': install Debian's dataset-fashion-mnist (bash scripts/setup.sh does)");
    }
    auto [pixels, shape] = read_idx(ip);
    auto [classes, lshape] = read_idx(lp);
    if (shape.size() != 3 || lshape.size() != 1 || shape[0] != lshape[0]) {
      throw std::runtime_error("unexpected Fashion-MNIST shapes in " + directory);
    }
    images = host_tensor(std::move(pixels), {shape[0], 1, shape[1], shape[2]}, at::kByte);
    labels = host_tensor(std::move(classes), {lshape[0]}, at::kByte);
  };
  load("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", train_images_, train_labels_);
  load("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", test_images_, test_labels_);
}

std::string FashionMnistDataset::describe() const {
  return "Fashion-MNIST, " + std::to_string(train_images_.size(0)) + " train / " +
         std::to_string(test_images_.size(0)) + " test images";
}

namespace {
Batch image_batch(const at::Tensor& images, const at::Tensor& labels, const at::Tensor& idx) {
  // uint8 [B,1,28,28] -> float, normalized with the data set's mean and std.
  auto x = (images.index_select(0, idx).to(at::kFloat) / 255.0 - 0.2860) / 0.3530;
  return {x, labels.index_select(0, idx).to(at::kLong)};
}
}  // namespace

Batch FashionMnistDataset::train_batch(int64_t index, int64_t batch_size, uint64_t seed) const {
  auto gen = batch_generator(seed, index);
  auto idx = at::randint(0, train_images_.size(0), {batch_size}, gen, at::TensorOptions().dtype(at::kLong));
  return image_batch(train_images_, train_labels_, idx);
}

int64_t FashionMnistDataset::eval_batch_count(int64_t batch_size) const {
  return test_images_.size(0) / batch_size;
}

Batch FashionMnistDataset::eval_batch(int64_t index, int64_t batch_size) const {
  auto idx = torch::arange(batch_size, at::TensorOptions().dtype(at::kLong)) + index * batch_size;
  return image_batch(test_images_, test_labels_, idx);
}

}  // namespace memfit
