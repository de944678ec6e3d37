#include "memfit/train/distributed.h"

#include <ATen/autocast_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if MEMFIT_WITH_CUDA && defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#if defined(MEMFIT_HAVE_GLOG) && defined(C10_USE_GLOG)
#include <glog/logging.h>
#endif

#include <algorithm>
#include <chrono>
#include <set>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "memfit/errors.h"
#include "memfit/techniques/checkpoint.h"

namespace memfit {
namespace {

// The first line of an exception's message, without LibTorch's backtrace.
std::string first_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string what = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  what = what.substr(0, what.find('\n'));
  return what.empty() ? "unknown error" : what;
}

std::string seconds_text(double s) {
  std::ostringstream out;
  out << s << " s";
  return out.str();
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// c10d logs each failed connection attempt of the rendezvous on stderr (through glog where
// LibTorch uses it, as Debian's 1.13 does; else through c10's own logging, with a stack trace,
// as PyPI's 2.x does); the failure that matters reaches the caller as one DistributedError line.
class QuietLogging {
 public:
#if defined(MEMFIT_HAVE_GLOG) && defined(C10_USE_GLOG)
  QuietLogging() : previous_(FLAGS_minloglevel) { FLAGS_minloglevel = google::GLOG_FATAL; }
  ~QuietLogging() { FLAGS_minloglevel = previous_; }

 private:
  int previous_;
#elif !defined(C10_USE_GLOG)
  QuietLogging() : previous_(FLAGS_caffe2_log_level) { FLAGS_caffe2_log_level = c10::GLOG_FATAL; }
  ~QuietLogging() { FLAGS_caffe2_log_level = previous_; }

 private:
  int previous_;
#endif
};


}  // namespace

std::pair<std::string, int> parse_master(const std::string& master) {
  const auto colon = master.rfind(':');
  const std::string value = "'" + master + "'";
  const std::string expected = "expected HOST:PORT, like 127.0.0.1:29500";
  check_option(colon != std::string::npos && colon != 0 && colon + 1 != master.size(), "distributed.master", value, expected);
  const std::string port_text = master.substr(colon + 1);
  check_option(port_text.find_first_not_of("0123456789") == std::string::npos && port_text.size() <= 5,
               "distributed.master", value, expected);
  const int port = std::stoi(port_text);
  check_option(port >= 1 && port <= 65535, "distributed.master", value, "the port must be 1 to 65535");
  std::string host = master.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return {host, port};
}

void validate(const DistributedOptions& o) {
  check_option(o.world_size >= 1, "distributed.world_size", o.world_size, "expected a positive integer");
  check_option(o.rank >= 0 && o.rank < o.world_size, "distributed.rank", o.rank,
               "expected 0 to " + std::to_string(o.world_size - 1) + " (one less than the world size)");
  check_option(o.zero_stage >= 0 && o.zero_stage <= 3, "zero_stage", o.zero_stage, "expected 0, 1, 2 or 3");
  check_option(o.timeout_seconds > 0 && o.timeout_seconds <= 86400, "distributed.timeout", seconds_text(o.timeout_seconds),
               "expected a positive number of seconds, at most a day (86400)");
  check_option(o.backend == "auto" || o.backend == "gloo" || o.backend == "nccl", "distributed.backend", o.backend,
               "expected auto, gloo or nccl");
  parse_master(o.master);  // checked even for one process: a typo should not wait for a second rank
}

// --- the process group ----------------------------------------------------------------------

struct DistributedContext::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<compat::ProcessGroupBackend> group;  // Gloo or NCCL
  std::string backend;
  double timeout_seconds = 30;
  int rank = 0;
  bool failed = false;

  // Waits for every work; the first failure becomes a DistributedError naming `what`.
  void wait(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const char* what) {
    std::string error;
    for (auto& work : works) {
      try {
        work->wait();
      } catch (const std::exception& e) {
        if (error.empty()) error = first_line(e);
      }
    }
    if (error.empty()) {
      // Gloo's worker thread drops its reference to a work just after completing it. Waiting
      // for that makes the last reference to every tensor ours, so a tensor released after a
      // collective (a gradient at stage 2) is freed on this thread, where the thread-local
      // MemoryTracker counts the free.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      for (auto& work : works) {
        while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      }
    }
    works.clear();
    if (!error.empty()) fail(what, error);
  }
  void wait(c10::intrusive_ptr<c10d::Work> work, const char* what) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works{std::move(work)};
    wait(works, what);
  }
  [[noreturn]] void fail(const char* what, const std::string& error) {
    failed = true;
    throw DistributedError("rank " + std::to_string(rank) + ": " + what + " failed: " + error +
                           " (another rank exited or stopped answering; timeout " + seconds_text(timeout_seconds) + ")");
  }
  // Issuing a collective can itself throw (a closed connection found at once).
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> issue(const char* what, Issue&& issue_fn) {
    try {
      return issue_fn();
    } catch (const std::exception& e) {
      fail(what, first_line(e));
    }
  }
};

DistributedContext::DistributedContext(const DistributedOptions& options)
    : options_(options), impl_(std::make_unique<Impl>()) {
  validate(options);
  const auto [host, port] = parse_master(options.master);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds * 1000));
  const std::string where = host + ":" + std::to_string(port);
  impl_->rank = options.rank;
  impl_->timeout_seconds = options.timeout_seconds;

  std::string backend = options.backend;
  if (backend == "auto") backend = "gloo";  // memfit trains on CPU tensors
  impl_->backend = backend;

  // Rendezvous: rank 0 serves a TCPStore and waits until every rank has connected to it.
  QuietLogging quiet;
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(port);
  store_options.isServer = options.rank == 0;
  store_options.numWorkers = static_cast<size_t>(options.world_size);
  store_options.waitWorkers = false;  // counted below: TCPStore's own wait ends silently at the timeout
  store_options.timeout = timeout;
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  } catch (const std::exception& e) {
    const std::string why = first_line(e);
    if (options.rank == 0) {
      throw DistributedError("rank 0: cannot open the rendezvous at --master " + where +
                             " (port in use or not a local address?): " + why);
    }
    throw DistributedError("rank " + std::to_string(options.rank) + ": cannot reach --master " + where + " within " +
                           seconds_text(options.timeout_seconds) + " (is rank 0 running?): " + why);
  }
  // Every rank counts itself in, then waits for the others.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  try {
    int64_t joined = impl_->store->add("memfit/joined", 1);
    while (joined < options.world_size) {
      if (std::chrono::steady_clock::now() > deadline) {
        impl_->failed = true;
        throw DistributedError("rank " + std::to_string(options.rank) + ": timed out after " + seconds_text(options.timeout_seconds) +
                               " waiting for the other ranks to join at " + where + " (" + std::to_string(joined) + " of " +
                               std::to_string(options.world_size) + " joined)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      joined = impl_->store->add("memfit/joined", 0);
    }
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    impl_->failed = true;
    throw DistributedError("rank " + std::to_string(options.rank) + ": the rendezvous at " + where + " failed: " + first_line(e));
  }

  try {
    if (backend == "gloo") {
#ifdef USE_C10D_GLOO
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
      // The transport binds to the interface named by GLOO_SOCKET_IFNAME (as in PyTorch), else
      // to loopback when the master is local, else to this host's address.
      if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (is_loopback(host)) {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host));
      } else {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      gloo_options->threads = 2;
      impl_->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, options.rank, options.world_size, gloo_options);
#else
      throw std::invalid_argument("this LibTorch was built without Gloo (USE_C10D_GLOO)");
#endif
    } else {
#if MEMFIT_WITH_CUDA && defined(USE_C10D_NCCL)
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      impl_->group = c10::make_intrusive<c10d::ProcessGroupNCCL>(impl_->store, options.rank, options.world_size, nccl_options);
#else
      throw std::invalid_argument("backend nccl needs memfit built against a CUDA LibTorch with NCCL");
#endif
    }
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    impl_->failed = true;
    throw DistributedError("rank " + std::to_string(options.rank) + ": connecting the " + backend + " process group via " +
                           where + " failed: " + first_line(e));
  }
}

DistributedContext::~DistributedContext() {
  if (impl_ && impl_->failed) {
    // After a failed collective the group's worker threads may still wait on dead peers, and
    // destroying the group would join them (up to a timeout per queued operation). The process
    // is about to report the error and exit: leave the group and the store undestroyed.
    (void)impl_->group.release();
    (void)impl_->store.release();
  }
}

std::string DistributedContext::backend_name() const { return impl_->backend; }

void DistributedContext::all_reduce_sum(const at::Tensor& tensor, const char* what) {
  std::vector<at::Tensor> tensors{tensor};
  impl_->wait(impl_->issue(what, [&] { return impl_->group->allreduce(tensors); }), what);
}

void DistributedContext::reduce_sum(const at::Tensor& tensor, int root, const char* what) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::ReduceOptions opts;
  opts.rootRank = root;
  impl_->wait(impl_->issue(what, [&] { return impl_->group->reduce(tensors, opts); }), what);
}

void DistributedContext::broadcast(const at::Tensor& tensor, int root, const char* what) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  impl_->wait(impl_->issue(what, [&] { return impl_->group->broadcast(tensors, opts); }), what);
}

void DistributedContext::send(const at::Tensor& tensor, int to, const char* what) {
  std::vector<at::Tensor> tensors{tensor};
  impl_->wait(impl_->issue(what, [&] { return impl_->group->send(tensors, to, 0); }), what);
}

void DistributedContext::receive(const at::Tensor& tensor, int from, const char* what) {
  std::vector<at::Tensor> tensors{tensor};
  impl_->wait(impl_->issue(what, [&] { return impl_->group->recv(tensors, from, 0); }), what);
}

std::vector<std::vector<int64_t>> DistributedContext::all_gather(const std::vector<int64_t>& values, const char* what) {
  const auto n = static_cast<int64_t>(values.size());
  std::vector<at::Tensor> input{at::tensor(values, at::kLong)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < world_size(); ++r) output[0].push_back(at::empty({n}, at::kLong));
  impl_->wait(impl_->issue(what, [&] { return impl_->group->allgather(output, input); }), what);
  std::vector<std::vector<int64_t>> result;
  for (const auto& t : output[0]) result.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  return result;
}

std::string DistributedContext::broadcast_string(const std::string& text, int root, const char* what) {
  // The length first, then the characters, one int64 each (a type every backend reduces).
  const at::Tensor length = at::tensor({static_cast<int64_t>(text.size())}, at::kLong);
  broadcast(length, root, what);
  const int64_t n = length.item<int64_t>();
  at::Tensor chars = rank() == root ? at::tensor(std::vector<int64_t>(text.begin(), text.end()), at::kLong)
                                    : at::empty({n}, at::kLong);
  if (n > 0) broadcast(chars, root, what);
  const int64_t* data = chars.data_ptr<int64_t>();
  return std::string(data, data + n);
}

void DistributedContext::check_same_on_all_ranks(const std::vector<std::pair<std::string, int64_t>>& named) {
  std::vector<int64_t> values;
  for (const auto& [name, value] : named) values.push_back(value);
  const auto all = all_gather(values, "checking that all ranks agree");
  for (size_t i = 0; i < named.size(); ++i) {
    for (int r = 0; r < world_size(); ++r) {
      if (all[static_cast<size_t>(r)][i] != all[0][i]) {
        throw std::invalid_argument("ranks disagree on " + named[i].first + ": rank 0 has " + std::to_string(all[0][i]) +
                                    ", rank " + std::to_string(r) + " has " + std::to_string(all[static_cast<size_t>(r)][i]) +
                                    " (every rank needs the same flags)");
      }
    }
  }
}

// --- partitioning ---------------------------------------------------------------------------

BatchSlice rank_slice(int64_t batch, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("rank_slice: rank " + std::to_string(rank) + " outside a world of " + std::to_string(world_size));
  }
  const int64_t base = batch / world_size, extra = batch % world_size;
  BatchSlice s;
  s.start = rank * base + std::min<int64_t>(rank, extra);
  s.length = base + (rank < extra ? 1 : 0);
  return s;
}

// --- sharded data parallel ------------------------------------------------------------------

ShardedDataParallel::ShardedDataParallel(DistributedContext& context, std::vector<at::Tensor> parameters, int zero_stage)
    : ShardedDataParallel(context, std::move(parameters), zero_stage, nullptr) {}

ShardedDataParallel::ShardedDataParallel(DistributedContext& context, Chain& chain, int zero_stage)
    : ShardedDataParallel(context, chain.parameters(), zero_stage, &chain) {}

ShardedDataParallel::~ShardedDataParallel() {
  if (chain_ != nullptr) chain_->set_block_runner({});  // the runner points here
}

ShardedDataParallel::ShardedDataParallel(DistributedContext& context, std::vector<at::Tensor> parameters, int zero_stage,
                                         Chain* chain)
    : context_(context), parameters_(std::move(parameters)), stage_(zero_stage), chain_(chain) {
  check_option(zero_stage >= 0 && zero_stage <= 3, "zero_stage", zero_stage, "expected 0, 1, 2 or 3");
  check_option(zero_stage < 3 || chain != nullptr, "zero_stage", zero_stage,
               "stage 3 shards blocks: construct ShardedDataParallel from the Chain");
  owner_ = partition_by_bytes(parameters_, world_size());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const auto& p = parameters_[i];
    if (!p.is_contiguous()) throw std::invalid_argument("ShardedDataParallel: parameter " + std::to_string(i) + " is not contiguous");
    total_bytes_ += static_cast<int64_t>(p.nbytes());
    if (owns(i)) owned_bytes_ += static_cast<int64_t>(p.nbytes());
  }
  context_.check_same_on_all_ranks({{"the number of parameters", static_cast<int64_t>(parameters_.size())},
                                    {"the parameter bytes (model flags)", total_bytes_},
                                    {"--zero", zero_stage}});
  // Ranks build the model from the same seed; broadcasting rank 0's weights makes equality a
  // guarantee rather than an assumption (as PyTorch's DistributedDataParallel does).
  at::NoGradGuard no_grad;
  auto& impl = *context_.impl_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto& p : parameters_) {
    std::vector<at::Tensor> t{p.detach()};
    works.push_back(impl.issue("broadcasting the initial weights", [&] { return impl.group->broadcast(t); }));
  }
  impl.wait(works, "broadcasting the initial weights");
  if (stage_ == 3) shard_blocks();
}

std::vector<at::Tensor> ShardedDataParallel::optimized_parameters() const {
  if (stage_ == 0) return parameters_;
  if (stage_ == 3) {
    std::vector<at::Tensor> shards;
    for (const auto& b : shards_) shards.push_back(b.shard);
    return shards;
  }
  std::vector<at::Tensor> mine;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (owns(i)) mine.push_back(parameters_[i]);
  }
  return mine;
}

void ShardedDataParallel::reduce_gradients() {
  if (stage_ == 3) return;  // reduced block by block in backward
  at::NoGradGuard no_grad;
  auto& impl = *context_.impl_;
  const char* what = stage_ == 2 ? "reducing gradients to their owners" : "all-reducing gradients";
  // Issued all at once, waited for together: Gloo runs them in order on its own threads.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    at::Tensor& grad = parameters_[i].mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(parameters_[i]);  // every rank must take part
    std::vector<at::Tensor> t{grad};
    if (stage_ == 2) {
      c10d::ReduceOptions opts;
      opts.rootRank = owner(i);
      works.push_back(impl.issue(what, [&] { return impl.group->reduce(t, opts); }));
    } else {
      works.push_back(impl.issue(what, [&] { return impl.group->allreduce(t); }));
    }
  }
  impl.wait(works, what);
  if (stage_ == 2) {
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (!owns(i)) parameters_[i].mutable_grad().reset();  // only the owner needs the sum
    }
  }
}

void ShardedDataParallel::finish_step(bool set_to_none) {
  if (stage_ == 0 || stage_ == 3) return;  // stage 3: each rank stepped its own shards, nothing to send
  at::NoGradGuard no_grad;
  if (stage_ == 1) {
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (owns(i)) continue;
      at::Tensor& grad = parameters_[i].mutable_grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        grad.reset();
      } else {
        grad.zero_();
      }
    }
  }
  auto& impl = *context_.impl_;
  const char* what = "broadcasting updated parameters from their owners";
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    std::vector<at::Tensor> t{parameters_[i].detach()};
    c10d::BroadcastOptions opts;
    opts.rootRank = owner(i);
    works.push_back(impl.issue(what, [&] { return impl.group->broadcast(t, opts); }));
  }
  impl.wait(works, what);
}

std::unique_ptr<torch::optim::Optimizer> ShardedDataParallel::gather_optimizer_state(torch::optim::Optimizer& sharded,
                                                                                   const OptimizerSpec& spec) {
  if (stage_ == 0) throw std::logic_error("gather_optimizer_state: at stage 0 every rank has the whole state");
  if (stage_ == 3) throw std::logic_error("gather_optimizer_state: not implemented at stage 3 (saving is refused there)");
  const char* what = "gathering the optimizer state on rank 0";
  std::unique_ptr<torch::optim::Optimizer> full = rank() == 0 ? make_optimizer(spec, parameters_) : nullptr;
  const size_t slots = param_state_slots(spec);
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const auto key = param_state_key(parameters_[i]);
    const int from = owner(i);
    if (from == 0 && rank() == 0) {
      auto it = sharded.state().find(key);
      if (it != sharded.state().end()) full->state()[key] = it->second->clone();  // tensors shared, not copied
    } else if (rank() == from) {
      send_param_state(sharded, key, slots, what);
    } else if (rank() == 0) {
      receive_param_state(*full, i, from, spec, what);
    }
  }
  return full;
}

// The header says whether the parameter has state, its step and which slots are defined; the
// defined tensors follow.
void ShardedDataParallel::send_param_state(torch::optim::Optimizer& sharded, const compat::OptimizerStateKey& key, size_t slots,
                                           const char* what) {
  auto it = sharded.state().find(key);
  ParamStateRecord record;
  if (it != sharded.state().end()) record = read_param_state(*it->second);
  std::vector<int64_t> header{it != sharded.state().end() ? 1 : 0, record.step};
  for (size_t s = 0; s < slots; ++s) header.push_back(s < record.tensors.size() && record.tensors[s].defined() ? 1 : 0);
  context_.send(at::tensor(header, at::kLong), 0, what);
  for (const auto& t : record.tensors) {
    if (t.defined()) context_.send(t.contiguous(), 0, what);
  }
}

void ShardedDataParallel::receive_param_state(torch::optim::Optimizer& full, size_t index, int from,
                                              const OptimizerSpec& spec, const char* what) {
  const at::Tensor& p = parameters_[index];
  at::Tensor header = at::empty({2 + static_cast<int64_t>(param_state_slots(spec))}, at::kLong);
  context_.receive(header, from, what);
  const auto h = header.accessor<int64_t, 1>();
  if (h[0] == 0) return;
  ParamStateRecord record;
  record.step = h[1];
  for (int64_t s = 2; s < header.size(0); ++s) {
    at::Tensor t;
    if (h[s] != 0) {
      t = empty_param_state_slot(spec, static_cast<size_t>(s - 2), p);  // 8-bit state: codes and absmax
      context_.receive(t, from, what);
    }
    record.tensors.push_back(t);
  }
  full.state()[param_state_key(p)] = make_param_state(spec, record);
}

void ShardedDataParallel::keep_owned_state(torch::optim::Optimizer& full, torch::optim::Optimizer& sharded) const {
  if (stage_ == 0) throw std::logic_error("keep_owned_state: at stage 0 every rank keeps the whole state");
  if (stage_ == 3) throw std::logic_error("keep_owned_state: not implemented at stage 3 (resuming is refused there)");
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!owns(i)) continue;
    const auto key = param_state_key(parameters_[i]);
    auto it = full.state().find(key);
    if (it != full.state().end()) sharded.state()[key] = std::move(it->second);
  }
  full.state().clear();  // the other ranks' shares are released here
}

// --- ZeRO stage 3 ---------------------------------------------------------------------------

void ShardedDataParallel::shard_blocks() {
  at::NoGradGuard no_grad;
  const int n = world_size();
  shard_of_block_.assign(static_cast<size_t>(chain_->size()), -1);
  total_bytes_ = owned_bytes_ = 0;
  std::set<const void*> seen;  // a parameter shared by two blocks (tied weights) cannot be in two shards
  for (int i = 0; i < chain_->size(); ++i) {
    BlockShard b;
    b.block = i;
    b.params = chain_->block_parameters(i, i);
    if (b.params.empty()) continue;
    std::vector<at::Tensor> flat_parts;
    for (const auto& p : b.params) {
      check_option(seen.insert(p.unsafeGetTensorImpl()).second, "zero_stage", 3,
                   "block " + std::to_string(i) + " (" + chain_->block(i).name +
                       ") shares a parameter with another block (tied weights): ZeRO 3 gathers one block at a time");
      check_option(p.scalar_type() == b.params.front().scalar_type() && p.device() == b.params.front().device(), "zero_stage", 3,
                   "the parameters of block " + std::to_string(i) + " (" + chain_->block(i).name +
                       ") must share one dtype and device to be sharded flat");
      check_option(p.requires_grad(), "zero_stage", 3,
                   "every parameter must require grad; block " + std::to_string(i) + " has a frozen one");
      b.offsets.push_back(b.numel);
      b.shapes.push_back(p.sizes().vec());
      b.numel += p.numel();
      flat_parts.push_back(p.detach().reshape({-1}));
    }
    b.shard_numel = shard_numel(b.numel, n);
    const at::Tensor flat = at::cat(flat_parts);
    flat_parts.clear();
    b.shard = own_range(b, flat).requires_grad_(true);
    total_bytes_ += b.numel * static_cast<int64_t>(flat.element_size());
    owned_bytes_ += static_cast<int64_t>(b.shard.nbytes());
    release(b);
    shard_of_block_[static_cast<size_t>(i)] = static_cast<int>(shards_.size());
    shards_.push_back(std::move(b));
  }
  install_runner();
}

void ShardedDataParallel::install_runner() {
  chain_->set_block_runner([this](int index, const at::Tensor& x, const BlockFn& run) { return run_block(index, x, run); });
}

void ShardedDataParallel::gather(BlockShard& b) {
  at::NoGradGuard no_grad;
  c10::InferenceMode normal_tensors(false);  // the parameters' data outlives an evaluation's inference mode
  at::autocast::clear_cache();  // a cached cast of a parameter is of its previous (released) value
  const int64_t s = b.shard_numel;
  const at::Tensor flat = at::empty({s * world_size()}, at::TensorOptions().dtype(b.shard.scalar_type()).device(b.shard.device()));
  flat.narrow(0, rank() * s, s).copy_(b.shard.detach());
  auto& impl = *context_.impl_;
  const char* what = "gathering a block's weights (ZeRO 3)";
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int r = 0; r < world_size(); ++r) {
    std::vector<at::Tensor> t{flat.narrow(0, r * s, s)};
    c10d::BroadcastOptions opts;
    opts.rootRank = r;
    works.push_back(impl.issue(what, [&] { return impl.group->broadcast(t, opts); }));
  }
  impl.wait(works, what);
  set_views(b, flat);
}

// One allocation for the block, freed when all its parameters are released.
void ShardedDataParallel::set_views(BlockShard& b, const at::Tensor& flat) {
  for (size_t i = 0; i < b.params.size(); ++i) {
    b.params[i].set_data(flat.narrow(0, b.offsets[i], c10::multiply_integers(b.shapes[i])).view(b.shapes[i]));
  }
}

at::Tensor ShardedDataParallel::own_range(const BlockShard& b, const at::Tensor& flat) const {
  const int64_t first = std::min<int64_t>(b.numel, rank() * b.shard_numel);
  const int64_t last = std::min<int64_t>(b.numel, (rank() + 1) * b.shard_numel);
  at::Tensor mine = at::zeros({b.shard_numel}, flat.options());  // the padding stays zero
  mine.narrow(0, 0, last - first).copy_(flat.narrow(0, first, last - first));
  return mine;
}

void ShardedDataParallel::release(BlockShard& b) {
  at::NoGradGuard no_grad;
  const auto empty = at::TensorOptions().dtype(b.shard.scalar_type()).device(b.shard.device());
  for (auto& p : b.params) {
    p.set_data(at::empty({0}, empty));
    p.mutable_grad().reset();  // (profiling through FullWeights leaves full gradients)
  }
}

// Each owner's range [r*s, (r+1)*s) of the flat layout is summed along a chain in rank order,
// 0 -> 1 -> ... -> N-1, then sent to its owner: ((g0 + g1) + g2) + ..., the order in which one
// process accumulates the ranks' micro-batches, so the sums are bit-equal to single-process
// training for any world size (Gloo's reduce sums in an order of its own; it has no
// reduce_scatter). c10d point-to-point sends, one range at a time on every rank.
at::Tensor ShardedDataParallel::reduce_to_shard(BlockShard& b, std::vector<at::Tensor> full_grads) {
  at::NoGradGuard no_grad;
  const int64_t s = b.shard_numel;
  std::vector<at::Tensor> flat_grads;
  for (size_t i = 0; i < b.params.size(); ++i) {
    const at::Tensor& g = full_grads[i];
    const int64_t numel = c10::multiply_integers(b.shapes[i]);
    flat_grads.push_back(g.defined() ? g.reshape({-1}) : at::zeros({numel}, b.shard.options()));  // all take part
  }
  full_grads.clear();
  at::Tensor shard_grad = at::zeros({s}, b.shard.options());  // the padding's gradient stays zero
  // Piece by piece (a piece: the part of one parameter's gradient inside a range), so that
  // nothing beyond one piece is allocated.
  for (int r = 0; r < world_size(); ++r) {
    for (size_t i = 0; i < b.params.size(); ++i) {
      const int64_t lo = std::max(b.offsets[i], r * s);
      const int64_t hi = std::min(b.offsets[i] + flat_grads[i].numel(), (r + 1) * s);
      if (lo >= hi) continue;
      const at::Tensor sum = sum_in_rank_order(flat_grads[i].narrow(0, lo - b.offsets[i], hi - lo), r);
      if (rank() == r) shard_grad.narrow(0, lo - r * s, hi - lo).copy_(sum);
    }
  }
  return shard_grad;
}

// One piece's chain: this rank adds its part to the sum of the ranks before it and passes
// it on; the owner gets the total (on other ranks the result is meaningless).
at::Tensor ShardedDataParallel::sum_in_rank_order(at::Tensor mine, int owner) {
  const char* what = "summing a block's gradients for their owner (ZeRO 3)";
  const int last = world_size() - 1;
  at::Tensor sum = mine;
  if (rank() > 0) {
    sum = at::empty_like(mine);
    context_.receive(sum, rank() - 1, what);
    sum.add_(mine);
  }
  if (rank() < last) {
    context_.send(sum, rank() + 1, what);
  } else if (owner != last) {
    context_.send(sum, owner, what);
  }
  if (rank() == owner && owner != last) context_.receive(sum, last, what);
  return sum;
}

at::Tensor ShardedDataParallel::run_block(int index, const at::Tensor& x, const BlockFn& run) {
  const int k = shard_of_block_.at(static_cast<size_t>(index));
  if (k < 0) return run(x);  // nothing to gather: an ordinary block
  GatheredParams g;
  g.params = shards_[static_cast<size_t>(k)].params;
  g.gather = [this, k] { gather(shards_[static_cast<size_t>(k)]); };
  g.release = [this, k] { release(shards_[static_cast<size_t>(k)]); };
  g.reduce = [this, k](std::vector<at::Tensor> grads) { return reduce_to_shard(shards_[static_cast<size_t>(k)], std::move(grads)); };
  return checkpoint_gathered(run, x, shards_[static_cast<size_t>(k)].shard, std::move(g), chain_->block_buffers(index, index),
                             chain_->may_write_input(index));
}

std::vector<GatheredBlockBytes> ShardedDataParallel::block_bytes() const {
  std::vector<GatheredBlockBytes> out(static_cast<size_t>(chain_ != nullptr ? chain_->size() : 0));
  for (const auto& b : shards_) {
    const auto element = static_cast<int64_t>(b.shard.element_size());
    out[static_cast<size_t>(b.block)] = {b.numel * element, b.shard_numel * element};
  }
  return out;
}

void ShardedDataParallel::for_each_gathered_block(const std::function<void(const std::vector<at::Tensor>&)>& visit) {
  TORCH_CHECK(stage_ == 3, "for_each_gathered_block: only at ZeRO stage 3 are the weights sharded");
  for (auto& b : shards_) {
    gather(b);
    try {
      visit(b.params);
    } catch (...) {
      release(b);
      throw;
    }
    release(b);
  }
}

// Rank 0: every rank's piece of s elements, in rank order (the flat block, padded); the other
// ranks send theirs and get an undefined tensor.
at::Tensor ShardedDataParallel::gather_to_rank0(const at::Tensor& piece, int64_t s, const char* what) {
  if (rank() != 0) {
    context_.send(piece.contiguous(), 0, what);
    return at::Tensor();
  }
  at::Tensor flat = at::empty({s * world_size()}, piece.options());
  flat.narrow(0, 0, s).copy_(piece);
  for (int r = 1; r < world_size(); ++r) context_.receive(flat.narrow(0, r * s, s), r, what);
  return flat;
}

// Rank 0: the block's whole weights (set as its parameters' values) and each parameter's
// state, in the block's parameter order; other ranks send theirs and get records to ignore.
ShardedDataParallel::BlockState ShardedDataParallel::gather_state_to_rank0(BlockShard& b, torch::optim::Optimizer& sharded,
                                                                          const char* what) {
  const at::Tensor weights = gather_to_rank0(b.shard.detach(), b.shard_numel, what);
  if (rank() == 0) set_views(b, weights);
  BlockState state(b.params.size());
  auto it = sharded.state().find(param_state_key(b.shard));
  if (it == sharded.state().end()) return state;  // not stepped yet: on every rank alike
  const ParamStateRecord mine = read_param_state(*it->second);
  for (auto& s : state) s = ParamStateRecord{mine.step, {}};
  for (const at::Tensor& slot : mine.tensors) {
    const at::Tensor flat = slot.defined() ? gather_to_rank0(slot, b.shard_numel, what) : at::Tensor();
    for (size_t i = 0; i < b.params.size(); ++i) {
      const int64_t numel = c10::multiply_integers(b.shapes[i]);
      state[i]->tensors.push_back(flat.defined() ? flat.narrow(0, b.offsets[i], numel).view(b.shapes[i]) : at::Tensor());
    }
  }
  return state;
}

void ShardedDataParallel::for_each_gathered_block_state(torch::optim::Optimizer& sharded, const OptimizerSpec& spec,
                                                        const std::function<void(int block, const BlockState& state)>& write) {
  TORCH_CHECK(stage_ == 3, "for_each_gathered_block_state: only at ZeRO stage 3 are the weights sharded");
  check_option(spec.state != StatePrecision::k8Bit, "optimizer.state", "8bit",
               "saving at ZeRO 3 needs fp32 state (8-bit blocks would straddle parameters)");
  at::NoGradGuard no_grad;
  const char* what = "gathering a block's weights and optimizer state on rank 0 to save (ZeRO 3)";
  for (int block = 0; block < chain_->size(); ++block) {
    const int k = shard_of_block_.at(static_cast<size_t>(block));
    if (k < 0) {
      if (rank() == 0) write(block, {});
      continue;
    }
    BlockShard& b = shards_[static_cast<size_t>(k)];
    const BlockState state = gather_state_to_rank0(b, sharded, what);
    if (rank() != 0) continue;
    try {
      write(block, state);
    } catch (...) {
      release(b);
      throw;
    }
    release(b);
  }
}

// This rank's range of a gathered block (whole values in its parameters) and of its saved
// state, into its shard and `sharded`'s state of it.
void ShardedDataParallel::keep_own_state(BlockShard& b, const BlockState& state, torch::optim::Optimizer& sharded,
                                         const OptimizerSpec& spec) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flat_parts;
  for (const auto& p : b.params) flat_parts.push_back(p.detach().reshape({-1}));
  b.shard.detach().copy_(own_range(b, at::cat(flat_parts)));
  sharded.state().erase(param_state_key(b.shard));
  const bool stepped = !state.empty() && state.front().has_value();
  for (const auto& r : state) {
    if (r.has_value() != stepped || (stepped && r->step != state.front()->step)) {
      throw std::runtime_error("cannot resume at ZeRO 3: block " + std::to_string(b.block) +
                               "'s parameters were saved after unequal numbers of optimizer steps (a shard has one)");
    }
  }
  if (!stepped) return;  // saved before any step
  ParamStateRecord mine{state.front()->step, {}};
  for (size_t slot = 0; slot < state.front()->tensors.size(); ++slot) {
    if (!state.front()->tensors[slot].defined()) {
      mine.tensors.emplace_back();
      continue;
    }
    std::vector<at::Tensor> parts;
    for (const auto& r : state) parts.push_back(r->tensors.at(slot).reshape({-1}));
    mine.tensors.push_back(own_range(b, at::cat(parts)));
  }
  sharded.state()[param_state_key(b.shard)] = make_param_state(spec, mine);
}

void ShardedDataParallel::load_block_states(const std::function<BlockState(int block)>& load, torch::optim::Optimizer& sharded,
                                            const OptimizerSpec& spec) {
  TORCH_CHECK(stage_ == 3, "load_block_states: only at ZeRO stage 3 are the weights sharded");
  check_option(spec.state != StatePrecision::k8Bit, "optimizer.state", "8bit",
               "resuming at ZeRO 3 needs fp32 state (8-bit blocks would straddle parameters)");
  for (int block = 0; block < chain_->size(); ++block) {
    const int k = shard_of_block_.at(static_cast<size_t>(block));
    if (k < 0) {
      load(block);  // its buffers
      continue;
    }
    BlockShard& b = shards_[static_cast<size_t>(k)];
    gather(b);  // whole parameters to load into
    try {
      keep_own_state(b, load(block), sharded, spec);
    } catch (...) {
      release(b);
      throw;
    }
    release(b);
  }
}

ShardedDataParallel::FullWeights::FullWeights(ShardedDataParallel& sdp) : sdp_(sdp) {
  TORCH_CHECK(sdp_.stage_ == 3, "FullWeights: only at ZeRO stage 3 are the weights sharded");
  sdp_.chain_->set_block_runner({});
  for (auto& b : sdp_.shards_) sdp_.gather(b);
}

ShardedDataParallel::FullWeights::~FullWeights() {
  for (auto& b : sdp_.shards_) sdp_.release(b);
  sdp_.install_runner();
}

}  // namespace memfit
