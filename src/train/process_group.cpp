#include "memfit/train/process_group.h"

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

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "memfit/compat.h"
#include "memfit/errors.h"
#include "memfit/runtime/step_config.h"

namespace memfit {
namespace {

using Work = c10::intrusive_ptr<c10d::Work>;

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
  check_option(o.prefetch_depth >= -1 && o.prefetch_depth <= kMaxPrefetchDepth, "prefetch_depth", o.prefetch_depth,
               "expected 0 to " + std::to_string(kMaxPrefetchDepth) + " (unset: the plan chooses)");
  check_option(o.prefetch_depth < 0 || o.zero_stage == 3, "prefetch_depth", o.prefetch_depth,
               "blocks are gathered ahead at ZeRO 3 only; this run is at stage " + std::to_string(o.zero_stage));
  check_option(o.timeout_seconds > 0 && o.timeout_seconds <= 86400, "distributed.timeout", seconds_text(o.timeout_seconds),
               "expected a positive number of seconds, at most a day (86400)");
  resolve_backend(o);
  parse_master(o.master);  // checked even for one process: a typo should not wait for a second rank
}

std::string resolve_backend(const DistributedOptions& o) {
  check_option(o.backend == "auto" || o.backend == "gloo" || o.backend == "nccl", "distributed.backend", o.backend,
               "expected auto, gloo or nccl");
#if MEMFIT_WITH_CUDA && defined(USE_C10D_NCCL)
  constexpr bool kHaveNccl = true;
#else
  constexpr bool kHaveNccl = false;
#endif
  if (o.backend == "nccl") {
    check_option(kHaveNccl, "distributed.backend", o.backend, "this memfit was built without NCCL (a CUDA LibTorch has it); use gloo");
    check_option(o.device.is_cuda(), "distributed.backend", o.backend,
                 "nccl carries CUDA tensors: train on --device cuda, or use gloo on the CPU");
    return "nccl";
  }
  if (o.backend == "gloo") return "gloo";
  return o.device.is_cuda() && kHaveNccl ? "nccl" : "gloo";
}

c10::Device rank_device(const c10::Device& device, int rank) {
  if (!device.is_cuda() || device.has_index()) return device;
  int local = rank;
  if (const char* text = std::getenv("LOCAL_RANK"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    check_option(*end == '\0' && value >= 0 && value < 1024, "LOCAL_RANK", std::string("'") + text + "'",
                 "expected this rank's index on its machine, 0 or more");
    local = static_cast<int>(value);
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local));
}

// --- the c10d group ---------------------------------------------------------------------------

// A CUDA tensor given to Gloo goes through a host copy; what the collective writes comes back
// once it is done.
struct HostCopies {
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (the caller's tensor, its host copy)
  void copy_back() {
    for (auto& [tensor, host] : written) tensor.copy_(host);
    written.clear();
  }
};

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<compat::ProcessGroupBackend> group;  // Gloo or NCCL
  std::string backend;
  c10::Device control_device = c10::Device(c10::kCPU);  // where the group's own small tensors go
  std::string where;  // HOST:PORT of the rendezvous
  double timeout_seconds = 30;
  int rank = 0;
  bool failed = false;

  void open_store(const DistributedOptions& o, const std::string& host, int port);
  void wait_for_ranks(int world_size);
  void connect(const DistributedOptions& o, const std::string& host);

  // Waits for every work; the first failure becomes a DistributedError naming `what`.
  void wait(std::vector<Work>& works, const char* what) {
    std::string error;
    for (auto& work : works) {
      try {
        work->wait();
      } catch (const std::exception& e) {
        if (error.empty()) error = first_line(e);
      }
    }
    if (error.empty()) drop_backend_references(works);
    works.clear();
    if (!error.empty()) fail(what, error);
  }
  // Gloo's worker thread drops its reference to a work just after completing it. Waiting for
  // that makes the last reference to every tensor ours, so a tensor released after a collective
  // (a gradient at stage 2) is freed on this thread, where the thread-local MemoryTracker counts
  // the free.
  static void drop_backend_references(std::vector<Work>& works) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (auto& work : works) {
      while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    }
  }
  void wait(Work work, const char* what) {
    std::vector<Work> works{std::move(work)};
    wait(works, what);
  }
  [[noreturn]] void fail(const char* what, const std::string& error) {
    failed = true;
    throw DistributedError("rank " + std::to_string(rank) + ": " + what + " failed: " + error +
                           " (another rank exited or stopped answering; timeout " + seconds_text(timeout_seconds) + ")");
  }
  // The tensor the backend is given: `t`, or for Gloo a host copy of a CUDA tensor (kept in
  // `copies` to be written back where the collective writes, `written`).
  at::Tensor for_backend(const at::Tensor& t, HostCopies& copies, bool written) const {
    if (backend != "gloo" || !t.is_cuda()) return t;
    at::Tensor host = t.to(at::kCPU);
    if (written) copies.written.emplace_back(t, host);
    return host;
  }
  // Issuing a collective can itself throw (a closed connection found at once).
  template <typename Issue>
  Work issue(const char* what, Issue&& issue_fn) {
    try {
      return issue_fn();
    } catch (const std::exception& e) {
      fail(what, first_line(e));
    }
  }
};

// Rank 0 serves a TCPStore; the others connect to it.
void ProcessGroup::Impl::open_store(const DistributedOptions& o, const std::string& host, int port) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(port);
  store_options.isServer = o.rank == 0;
  store_options.numWorkers = static_cast<size_t>(o.world_size);
  store_options.waitWorkers = false;  // counted in wait_for_ranks: TCPStore's own wait ends silently at the timeout
  store_options.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_seconds * 1000));
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  } catch (const std::exception& e) {
    if (o.rank == 0) {
      throw DistributedError("rank 0: cannot open the rendezvous at " + where + " (port in use or not a local address?): " +
                             first_line(e));
    }
    throw DistributedError("rank " + std::to_string(o.rank) + ": cannot reach the rendezvous at " + where + " within " +
                           seconds_text(o.timeout_seconds) + " (is rank 0 running?): " + first_line(e));
  }
}

// Every rank counts itself in, then waits for the others.
void ProcessGroup::Impl::wait_for_ranks(int world_size) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  try {
    int64_t joined = store->add("memfit/joined", 1);
    while (joined < world_size) {
      if (std::chrono::steady_clock::now() > deadline) {
        failed = true;
        throw DistributedError("rank " + std::to_string(rank) + ": timed out after " + seconds_text(timeout_seconds) +
                               " waiting for the other ranks to join at " + where + " (" + std::to_string(joined) + " of " +
                               std::to_string(world_size) + " joined)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      joined = store->add("memfit/joined", 0);
    }
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    failed = true;
    throw DistributedError("rank " + std::to_string(rank) + ": the rendezvous at " + where + " failed: " + first_line(e));
  }
}

void ProcessGroup::Impl::connect(const DistributedOptions& o, const std::string& host) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_seconds * 1000));
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
    group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, o.rank, o.world_size, gloo_options);
#else
    throw std::invalid_argument("this LibTorch was built without Gloo (USE_C10D_GLOO)");
#endif
  } else {
#if MEMFIT_WITH_CUDA && defined(USE_C10D_NCCL)
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = timeout;
    group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, o.rank, o.world_size, nccl_options);
#else
    throw std::invalid_argument("backend nccl needs memfit built against a CUDA LibTorch with NCCL");
#endif
  }
}

ProcessGroup::ProcessGroup() = default;

ProcessGroup::ProcessGroup(const DistributedOptions& options) : options_(options) {
  validate(options);
  if (!options.enabled()) return;  // a group of one
  impl_ = std::make_unique<Impl>();
  const auto [host, port] = parse_master(options.master);
  impl_->where = host + ":" + std::to_string(port);
  impl_->rank = options.rank;
  impl_->timeout_seconds = options.timeout_seconds;
  impl_->backend = resolve_backend(options);
  if (impl_->backend == "nccl") impl_->control_device = options.device;
  QuietLogging quiet;
  impl_->open_store(options, host, port);
  impl_->wait_for_ranks(options.world_size);
  try {
    impl_->connect(options, host);
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    impl_->failed = true;
    throw DistributedError("rank " + std::to_string(options.rank) + ": connecting the " + impl_->backend +
                           " process group via " + impl_->where + " failed: " + first_line(e));
  }
}

ProcessGroup::~ProcessGroup() {
  if (impl_ && impl_->failed) {
    // After a failed collective the group's worker threads may still wait on dead peers, and
    // destroying the group would join them (up to a timeout per queued operation). The process
    // is about to report the error and exit: leave the group and the store undestroyed.
    (void)impl_->group.release();
    (void)impl_->store.release();
  }
}

std::string ProcessGroup::backend_name() const { return impl_ ? impl_->backend : "none"; }

void ProcessGroup::all_reduce_sum(const at::Tensor& tensor, const char* what) {
  if (!impl_) return;
  HostCopies copies;
  std::vector<at::Tensor> tensors{impl_->for_backend(tensor, copies, true)};
  impl_->wait(impl_->issue(what, [&] { return impl_->group->allreduce(tensors); }), what);
  copies.copy_back();
}

void ProcessGroup::reduce_sum(const at::Tensor& tensor, int root, const char* what) {
  if (!impl_) return;
  HostCopies copies;
  std::vector<at::Tensor> tensors{impl_->for_backend(tensor, copies, true)};
  c10d::ReduceOptions opts;
  opts.rootRank = root;
  impl_->wait(impl_->issue(what, [&] { return impl_->group->reduce(tensors, opts); }), what);
  copies.copy_back();
}

void ProcessGroup::broadcast(const at::Tensor& tensor, int root, const char* what) {
  if (!impl_) return;
  HostCopies copies;
  std::vector<at::Tensor> tensors{impl_->for_backend(tensor, copies, rank() != root)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  impl_->wait(impl_->issue(what, [&] { return impl_->group->broadcast(tensors, opts); }), what);
  copies.copy_back();
}

void ProcessGroup::send(const at::Tensor& tensor, int to, const char* what) {
  TORCH_CHECK(impl_ != nullptr, "memfit::ProcessGroup::send: a group of one has no other rank");
  HostCopies copies;
  std::vector<at::Tensor> tensors{impl_->for_backend(tensor, copies, false)};
  impl_->wait(impl_->issue(what, [&] { return impl_->group->send(tensors, to, 0); }), what);
}

void ProcessGroup::receive(const at::Tensor& tensor, int from, const char* what) {
  TORCH_CHECK(impl_ != nullptr, "memfit::ProcessGroup::receive: a group of one has no other rank");
  HostCopies copies;
  std::vector<at::Tensor> tensors{impl_->for_backend(tensor, copies, true)};
  impl_->wait(impl_->issue(what, [&] { return impl_->group->recv(tensors, from, 0); }), what);
  copies.copy_back();
}

c10::Device ProcessGroup::control_device() const { return impl_ ? impl_->control_device : c10::Device(c10::kCPU); }

double ProcessGroup::sum(double value, const char* what) {
  const at::Tensor total = at::tensor({value}, at::kDouble).to(control_device());
  all_reduce_sum(total, what);
  return total.item<double>();
}

bool ProcessGroup::any(bool flag, const char* what) {
  const at::Tensor count = at::tensor({flag ? int64_t{1} : int64_t{0}}, at::kLong).to(control_device());
  all_reduce_sum(count, what);
  return count.item<int64_t>() > 0;
}

std::vector<std::vector<int64_t>> ProcessGroup::all_gather(const std::vector<int64_t>& values, const char* what) {
  if (!impl_) return {values};
  const auto n = static_cast<int64_t>(values.size());
  const c10::Device device = control_device();
  std::vector<at::Tensor> input{at::tensor(values, at::kLong).to(device)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < world_size(); ++r) output[0].push_back(at::empty({n}, at::dtype(at::kLong).device(device)));
  impl_->wait(impl_->issue(what, [&] { return impl_->group->allgather(output, input); }), what);
  std::vector<std::vector<int64_t>> result;
  for (const auto& gathered : output[0]) {
    const at::Tensor t = gathered.cpu();
    result.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  return result;
}

std::string ProcessGroup::broadcast_string(const std::string& text, int root, const char* what) {
  if (!impl_) return text;
  // The length first, then the characters, one int64 each (a type every backend reduces).
  const c10::Device device = control_device();
  const at::Tensor length = at::tensor({static_cast<int64_t>(text.size())}, at::kLong).to(device);
  broadcast(length, root, what);
  const int64_t n = length.item<int64_t>();
  at::Tensor chars = rank() == root ? at::tensor(std::vector<int64_t>(text.begin(), text.end()), at::kLong).to(device)
                                    : at::empty({n}, at::dtype(at::kLong).device(device));
  if (n > 0) broadcast(chars, root, what);
  chars = chars.cpu();
  const int64_t* data = chars.data_ptr<int64_t>();
  return std::string(data, data + n);
}

void ProcessGroup::check_same_on_all_ranks(const std::vector<std::pair<std::string, int64_t>>& named) {
  std::vector<int64_t> values;
  for (const auto& [name, value] : named) values.push_back(value);
  const auto all = all_gather(values, "checking that all ranks agree");
  for (size_t i = 0; i < named.size(); ++i) {
    for (int r = 0; r < world_size(); ++r) {
      if (all[static_cast<size_t>(r)][i] != all[0][i]) {
        throw std::invalid_argument("ranks disagree on " + named[i].first + ": rank 0 has " + std::to_string(all[0][i]) +
                                    ", rank " + std::to_string(r) + " has " + std::to_string(all[static_cast<size_t>(r)][i]) +
                                    " (every rank needs the same settings)");
      }
    }
  }
}

// --- collectives in flight --------------------------------------------------------------------

struct PendingCollectives::Works {
  std::vector<Work> works;
  HostCopies copies;
};

PendingCollectives::PendingCollectives(ProcessGroup& group, const char* what)
    : group_(group), what_(what), works_(std::make_unique<Works>()) {}

PendingCollectives::~PendingCollectives() {
  if (works_->works.empty()) return;
  try {
    wait();
  } catch (const std::exception&) {  // unwinding from another error: that one is reported
  }
}

void PendingCollectives::broadcast(const at::Tensor& tensor, int root) {
  if (!group_.impl_) return;
  auto& impl = *group_.impl_;
  std::vector<at::Tensor> tensors{impl.for_backend(tensor, works_->copies, group_.rank() != root)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  works_->works.push_back(impl.issue(what_, [&] { return impl.group->broadcast(tensors, opts); }));
}

void PendingCollectives::all_reduce_sum(const at::Tensor& tensor) {
  if (!group_.impl_) return;
  auto& impl = *group_.impl_;
  std::vector<at::Tensor> tensors{impl.for_backend(tensor, works_->copies, true)};
  works_->works.push_back(impl.issue(what_, [&] { return impl.group->allreduce(tensors); }));
}

void PendingCollectives::reduce_sum(const at::Tensor& tensor, int root) {
  if (!group_.impl_) return;
  auto& impl = *group_.impl_;
  std::vector<at::Tensor> tensors{impl.for_backend(tensor, works_->copies, true)};
  c10d::ReduceOptions opts;
  opts.rootRank = root;
  works_->works.push_back(impl.issue(what_, [&] { return impl.group->reduce(tensors, opts); }));
}

void PendingCollectives::send(const at::Tensor& tensor, int to, int tag) {
  if (!group_.impl_) return;
  auto& impl = *group_.impl_;
  std::vector<at::Tensor> tensors{impl.for_backend(tensor, works_->copies, false)};
  works_->works.push_back(impl.issue(what_, [&] { return impl.group->send(tensors, to, tag); }));
}

void PendingCollectives::receive(const at::Tensor& tensor, int from, int tag) {
  if (!group_.impl_) return;
  auto& impl = *group_.impl_;
  std::vector<at::Tensor> tensors{impl.for_backend(tensor, works_->copies, true)};
  works_->works.push_back(impl.issue(what_, [&] { return impl.group->recv(tensors, from, tag); }));
}

void PendingCollectives::wait() {
  if (!group_.impl_) return;
  group_.impl_->wait(works_->works, what_);
  works_->copies.copy_back();
}

}  // namespace memfit
