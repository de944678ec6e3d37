#include "memfit/techniques/activation_offload.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "memfit/measure/memory_space.h"
#include "memfit/measure/memory_tracker.h"

namespace memfit {
namespace {

// One storage a block saved: its whole contents on the host between forward and backward, and
// on the device again once backward reaches the block.
struct MovedStorage {
  explicit MovedStorage(const at::Tensor& t) : origin(t.storage().getWeakStorageImpl()), where(t.device()) {}
  c10::weak_intrusive_ptr<c10::StorageImpl> origin;  // to tell a live storage from a reused address
  at::Tensor host;    // flat copy (undefined once brought back, or when kept on the device)
  at::Tensor device;  // flat, on the device (undefined while on the host)
  std::unique_ptr<CopyToDevice> incoming;  // prefetched: on its way back
  c10::Device where;
};

// A flat tensor over all of `t`'s storage, of t's dtype.
at::Tensor flat_storage(const at::Tensor& t) {
  const int64_t numel = static_cast<int64_t>(t.storage().nbytes() / t.element_size());
  return at::empty({0}, t.options()).set_(t.storage(), 0, {numel}, {1});
}

}  // namespace

// One block's run: the storages its graph saved, moved together.
class OffloadedActivations {
 public:
  OffloadedActivations(const at::Tensor& input, const std::vector<at::Tensor>& stay) : tracker_(MemoryTracker::active()) {
    stay_.push_back(storage_of(input));
    for (const auto& t : stay) stay_.push_back(storage_of(t));
    if (tracker_ != nullptr) first_order_ = tracker_->next_allocation_order();
  }

  // What a saved tensor becomes: a view of a moved storage, or the tensor itself when it stays.
  struct Packed {
    std::shared_ptr<MovedStorage> storage;  // null: `kept` is the tensor, on the device
    at::Tensor kept;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
  };

  Packed pack(const at::Tensor& t) {
    Packed p;
    if (stays(t)) {
      p.kept = t;
      return p;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    std::weak_ptr<MovedStorage>& known = moved_[{storage_of(t), t.scalar_type()}];
    std::shared_ptr<MovedStorage> entry = known.lock();
    if (!entry || !entry->origin.lock()) {  // first seen (or the address was reused)
      entry = std::make_shared<MovedStorage>(t);
      entry->host = copy_to_host(flat_storage(t));
      known = entry;
    }
    p.storage = entry;
    p.sizes = t.sizes().vec();
    p.strides = t.strides().vec();
    p.offset = t.storage_offset();
    return p;
  }

  at::Tensor unpack(const Packed& p) {
    if (!p.storage) return p.kept;
    bring_back();
    const at::Tensor& flat = p.storage->device;
    return at::empty({0}, flat.options()).set_(flat.storage(), p.offset, p.sizes, p.strides);
  }

  // Its output is read by the next block: kept on the device, its host copy dropped.
  void keep_on_device(const at::Tensor& output) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = moved_.find({storage_of(output), output.scalar_type()});
    const std::shared_ptr<MovedStorage> entry = it == moved_.end() ? nullptr : it->second.lock();
    if (!entry || !entry->origin.lock()) return;
    entry->device = flat_storage(output);
    entry->host = at::Tensor();
  }

  // Every moved storage on its way back to the device, beside the caller's work (the device
  // memory made now); bring_back waits for them.
  void prefetch() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, known] : moved_) {
      const std::shared_ptr<MovedStorage> entry = known.lock();
      if (!entry || !entry->host.defined() || entry->incoming) continue;
      entry->incoming = std::make_unique<CopyToDevice>(entry->host, entry->where);
    }
  }

  // Every moved storage back on the device (once; the host copies freed).
  void bring_back() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, known] : moved_) {
      const std::shared_ptr<MovedStorage> entry = known.lock();
      if (!entry || !entry->host.defined()) continue;
      entry->device = entry->incoming ? entry->incoming->wait() : copy_to_device(entry->host, entry->where);
      entry->incoming.reset();
      entry->host = at::Tensor();
    }
  }

 private:
  static const void* storage_of(const at::Tensor& t) {
    return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  }
  bool stays(const at::Tensor& t) const {
    // A tensor without storage of its own (a wrapped number) or of no bytes gains nothing.
    if (!t.defined() || !t.has_storage() || t.storage().nbytes() == 0 || t.is_sparse()) return true;
    if (std::find(stay_.begin(), stay_.end(), storage_of(t)) != stay_.end()) return true;
    // Made before the block ran: someone else keeps it alive.
    return tracker_ != nullptr && tracker_->allocation_order(t.storage().data()) < first_order_;
  }

  MemoryTracker* tracker_;
  int64_t first_order_ = 0;
  std::vector<const void*> stay_;
  std::mutex mutex_;
  // Owned by the saved tensors that use them: a storage's device copy goes with the last of them,
  // after its node's backward, as it would without offload.
  std::map<std::pair<const void*, at::ScalarType>, std::weak_ptr<MovedStorage>> moved_;
};

namespace {

thread_local std::shared_ptr<OffloadedActivations> t_offloading;  // the block running offloaded, if any

class OffloadHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit OffloadHooks(std::shared_ptr<OffloadedActivations> block) : block_(std::move(block)) {}
  void call_pack_hook(const at::Tensor& tensor) override { packed_ = block_->pack(tensor); }
  at::Tensor call_unpack_hook() override { return block_->unpack(packed_); }

 private:
  std::shared_ptr<OffloadedActivations> block_;  // kept alive by the graph that saved into it
  OffloadedActivations::Packed packed_;
};

// LibTorch's engine, handing out memfit's hooks while a block runs offloaded on the thread.
class OffloadingEngine final : public torch::autograd::Engine {
 public:
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (!t_offloading) return nullptr;
    return std::make_unique<OffloadHooks>(t_offloading);
  }
};

torch::autograd::Engine& offloading_engine() {
  static auto* engine = new OffloadingEngine();  // never destroyed, as LibTorch's own
  return *engine;
}

// Makes the offloading engine the default once, unless another (Python's) is.
bool install_engine() {
  static const bool installed = [] {
    auto& current = torch::autograd::Engine::get_default_engine();
    if (&current != &torch::autograd::Engine::get_base_engine()) return false;
    torch::autograd::set_default_engine_stub(&offloading_engine);
    return true;
  }();
  return installed;
}

}  // namespace

bool activation_offload_available() { return install_engine(); }

at::Tensor run_offloaded(const std::function<at::Tensor(const at::Tensor&)>& block, const at::Tensor& x,
                         const std::vector<at::Tensor>& stay, std::shared_ptr<OffloadedActivations>* activations) {
  if (!at::GradMode::is_enabled() || !install_engine()) return block(x);
  auto offloaded = std::make_shared<OffloadedActivations>(x, stay);
  if (activations != nullptr) *activations = offloaded;
  at::Tensor y;
  {
    const auto previous = std::exchange(t_offloading, offloaded);
    struct Restore {
      std::shared_ptr<OffloadedActivations> previous;
      ~Restore() { t_offloading = previous; }
    } restore{previous};
    y = block(x);
  }
  offloaded->keep_on_device(y);
  if (y.requires_grad()) {
    // Backward reaches the block: its activations come back before any of its nodes runs.
    y.register_hook([offloaded](const at::Tensor&) { offloaded->bring_back(); });
  }
  return y;
}

void prefetch_when_reached(const at::Tensor& later, std::shared_ptr<OffloadedActivations> activations) {
  if (!activations || !later.requires_grad()) return;
  later.register_hook([activations](const at::Tensor&) { activations->prefetch(); });
}

}  // namespace memfit
