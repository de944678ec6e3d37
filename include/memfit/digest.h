// digest.h — sha256 (OpenSSL's EVP interface), usable from every layer: saved state checks its
// files with it, the profile cache names and keys its files with it.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace memfit {

// Incremental: add() the bytes in order, then hex() once.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void add(const void* data, size_t size);
  std::string hex();  // lowercase, 64 digits

 private:
  struct Context;
  std::unique_ptr<Context> ctx_;
};

std::string sha256_hex(const void* data, size_t size);
inline std::string sha256_hex(const std::string& bytes) { return sha256_hex(bytes.data(), bytes.size()); }
// Of a file's bytes, read in 1 MiB pieces; throws std::runtime_error naming the file it cannot read.
std::string sha256_file(const std::string& path);

}  // namespace memfit
