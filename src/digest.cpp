#include "memfit/digest.h"

#include <openssl/evp.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <vector>

namespace memfit {

// (OpenSSL 3's EVP interface: the SHA256_* functions are deprecated there.)
struct Sha256::Context {
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  ~Context() { EVP_MD_CTX_free(md); }
};

Sha256::Sha256() : ctx_(std::make_unique<Context>()) {
  if (ctx_->md == nullptr || EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("sha256: cannot initialise OpenSSL's digest");
  }
}

Sha256::~Sha256() = default;

void Sha256::add(const void* data, size_t size) { EVP_DigestUpdate(ctx_->md, data, size); }

std::string Sha256::hex() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx_->md, digest, &length);
  std::string out;
  char two[3];
  for (unsigned int i = 0; i < length; ++i) {
    std::snprintf(two, sizeof two, "%02x", digest[i]);
    out += two;
  }
  return out;
}

std::string sha256_hex(const void* data, size_t size) {
  Sha256 sha;
  sha.add(data, size);
  return sha.hex();
}

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("sha256: cannot read " + path);
  Sha256 sha;
  std::vector<char> piece(1 << 20);
  while (in) {
    in.read(piece.data(), static_cast<std::streamsize>(piece.size()));
    sha.add(piece.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) throw std::runtime_error("sha256: cannot read " + path);
  return sha.hex();
}

}  // namespace memfit
