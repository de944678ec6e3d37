// process_group.h — the ranks of a data-parallel run, over torch.distributed's C++ core (c10d):
// a TCPStore rendezvous on rank 0, then Gloo (CPU tensors) or NCCL (CUDA tensors, in a CUDA
// build). A group of one
// process needs no c10d at all: its collectives return at once, so code above it runs the same
// whether it is one of N ranks or alone.
//
//   memfit::DistributedOptions o;  o.world_size = 2;  o.rank = r;  o.master = "127.0.0.1:29500";
//   memfit::ProcessGroup group(o);                        // blocks until every rank has joined
//   group.all_reduce_sum(t, "summing the loss");          // `what` names the operation in errors
//
//   memfit::PendingCollectives pending(group, "broadcasting weights");
//   for (auto& p : params) pending.broadcast(p, 0);       // issued at once, in order
//   pending.wait();                                       // then waited for together
//
// Every failure of the rendezvous or of a collective (a peer died, a timeout) throws
// DistributedError: one line naming the rank and the operation.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace memfit {

struct DistributedOptions {
  int world_size = 1;                   // 1: not distributed
  int rank = 0;
  std::string master = "127.0.0.1:29500";  // HOST:PORT of the rendezvous store rank 0 opens
  int zero_stage = 0;                   // 0 to 3: which strategy (strategy.h)
  int prefetch_depth = -1;              // ZeRO 3: blocks gathered ahead, 0 to 2; -1: the plan chooses
  double timeout_seconds = 30;          // rendezvous and every collective
  std::string backend = "auto";         // auto (nccl for CUDA tensors, else gloo) | gloo | nccl
  // The device of the tensors the group carries: the step's (the Trainer sets it). NCCL carries
  // CUDA tensors and its small control tensors on that GPU; Gloo is only ever given CPU tensors
  // (a CUDA tensor goes through a host copy).
  c10::Device device = c10::Device(c10::kCPU);
  bool enabled() const { return world_size > 1; }
};

// The backend options.backend names, auto resolved: NCCL where the tensors are on CUDA and this
// build has NCCL, Gloo otherwise. Throws OptionError("distributed.backend", ...) for nccl with
// CPU tensors or a build without NCCL.
std::string resolve_backend(const DistributedOptions& options);

// The device a rank trains on: CUDA without an index is one GPU per local rank (LOCAL_RANK, as
// `memfit launch` and torchrun set it; else the rank); any other device as it is.
c10::Device rank_device(const c10::Device& device, int rank);

// Throws OptionError naming the option (distributed.world_size, .rank, .master, .timeout,
// .backend, zero_stage, prefetch_depth).
void validate(const DistributedOptions& options);

// HOST:PORT split; throws OptionError naming distributed.master.
std::pair<std::string, int> parse_master(const std::string& master);

// The rendezvous failed, or a collective did (a peer exited, a timeout): one line, saying which.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ProcessGroup {
 public:
  // A group of one: this process alone.
  ProcessGroup();
  // world_size ranks joined through a TCPStore on rank 0 (a group of one when world_size is 1).
  // Blocks until every rank has joined or options.timeout_seconds pass.
  explicit ProcessGroup(const DistributedOptions& options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  const DistributedOptions& options() const { return options_; }
  std::string backend_name() const;  // "gloo", "nccl", or "none" for a group of one
  // Where the group's own small tensors (sums, flags, texts) live: the GPU for NCCL, else the CPU.
  c10::Device control_device() const;

  // Collectives on one tensor each; each returns when it is done on this rank.
  void all_reduce_sum(const at::Tensor& tensor, const char* what);
  void reduce_sum(const at::Tensor& tensor, int root, const char* what);
  void broadcast(const at::Tensor& tensor, int root, const char* what);
  void send(const at::Tensor& tensor, int to, const char* what);
  void receive(const at::Tensor& tensor, int from, const char* what);

  // The sum of `value` over the ranks.
  double sum(double value, const char* what);
  // Whether `flag` is set on any rank.
  bool any(bool flag, const char* what);
  // `root`'s text, on every rank (the others' `text` is ignored).
  std::string broadcast_string(const std::string& text, int root, const char* what);
  // Every rank's values (same count on every rank), rank by rank.
  std::vector<std::vector<int64_t>> all_gather(const std::vector<int64_t>& values, const char* what);
  // Throws std::invalid_argument naming the first value on which ranks differ: the settings that
  // must agree (model shape, batch, steps, stage) are checked before training starts, so a
  // mismatch is one clear line rather than a hang in a collective.
  void check_same_on_all_ranks(const std::vector<std::pair<std::string, int64_t>>& named_values);

 private:
  friend class PendingCollectives;
  struct Impl;
  DistributedOptions options_;
  std::unique_ptr<Impl> impl_;  // null in a group of one
};

// Collectives issued one after another without waiting (the backend runs them in order on its
// own threads), then waited for together. The tensors must stay alive until wait() returns.
class PendingCollectives {
 public:
  PendingCollectives(ProcessGroup& group, const char* what);
  ~PendingCollectives();  // waits for what is still pending (errors then go unreported)
  PendingCollectives(const PendingCollectives&) = delete;
  PendingCollectives& operator=(const PendingCollectives&) = delete;

  void broadcast(const at::Tensor& tensor, int root);
  void all_reduce_sum(const at::Tensor& tensor);
  void reduce_sum(const at::Tensor& tensor, int root);
  // Point to point: a message is matched by sender, receiver and tag, so several may be in
  // flight between two ranks at once when their tags differ.
  void send(const at::Tensor& tensor, int to, int tag);
  void receive(const at::Tensor& tensor, int from, int tag);
  // Returns when every collective issued is done; the first failure throws DistributedError.
  void wait();

 private:
  struct Works;
  ProcessGroup& group_;
  const char* what_;
  std::unique_ptr<Works> works_;
};

}  // namespace memfit
