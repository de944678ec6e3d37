// Helpers for tests of ranks as threads of this process (c10d/Gloo over loopback, no fork
// needed): a free port, the ranks run together, a small chain and its batches.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <exception>
#include <functional>
#include <thread>

#include "test_util.h"

namespace memfit::test {

// A port nothing listens on now (the kernel's choice).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Runs `rank_body(rank)` for ranks 0 to world - 1, each on a thread of its own (rank 0 on
// this one), and rethrows the first failure.
inline void run_ranks(int world, const std::function<void(int)>& rank_body) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  auto run_rank = [&](int rank) {
    try {
      rank_body(rank);
    } catch (...) {
      errors[static_cast<size_t>(rank)] = std::current_exception();
    }
  };
  std::vector<std::thread> others;
  for (int r = 1; r < world; ++r) others.emplace_back(run_rank, r);
  run_rank(0);
  for (auto& t : others) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// A small chain with a parameterless block and parameter counts that no world size divides:
// padding and pieces that straddle parameters are exercised. Weights are deterministic.
inline std::shared_ptr<Chain> small_chain() {
  auto chain = std::make_shared<Chain>();
  chain->add("fc1", torch::nn::Linear(7, 13).ptr());
  chain->add("relu", torch::nn::ReLU().ptr());
  chain->add("fc2", torch::nn::Linear(13, 11).ptr());
  chain->add("fc3", torch::nn::Linear(11, 3).ptr());
  at::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : chain->parameters()) p.copy_(at::sin(at::linspace(0, 5, p.numel()) * (1.0 + i++)).reshape(p.sizes()) * 0.3);
  return chain;
}

inline Batch chain_batch(int step) {
  const at::Tensor x = at::cos(at::linspace(0, 7, 8 * 7) + step).reshape({8, 7});
  const at::Tensor y = at::sin(at::linspace(0, 3, 8 * 3) * (step + 1)).reshape({8, 3});
  return {x, y};
}

// Forward and backward of `part`, its loss weighted by its share of the global batch (as each
// rank weighs its slice). Returns the weighted loss.
inline double chain_micro_batch(Chain& chain, const Batch& part, int64_t global_batch) {
  const at::Tensor loss = at::mse_loss(chain.forward(part.input), part.target) * (static_cast<double>(part.size()) / global_batch);
  loss.backward();
  return loss.item<double>();
}

}  // namespace memfit::test
