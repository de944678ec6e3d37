#include "plan/part_measure.h"

#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "memfit/techniques/grads.h"

namespace memfit {
namespace {

// A tensor's own bytes (a view of a larger storage, such as a micro-batch, counts its part).
int64_t tensor_bytes(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return 0;
  return std::min(static_cast<int64_t>(t.storage().nbytes()), static_cast<int64_t>(t.numel() * t.element_size()));
}

const void* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().data() : nullptr;
}

StorageAt storage_at(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return {};
  return {t.storage().data(), static_cast<int64_t>(t.storage().nbytes())};
}

// Bytes alive now by the part tag they were allocated under (tags 0 .. parts-1), from the
// events recorded since the run started.
std::vector<int64_t> live_bytes_by_tag(const MemoryTracker& tracker, MemoryDevice device, int parts) {
  std::unordered_map<const void*, std::pair<int16_t, int64_t>> live;
  for (const MemoryEvent& e : tracker.events()) {
    if (e.device != device) continue;
    if (e.delta > 0) {
      live[e.ptr] = {e.block, e.delta};
    } else {
      live.erase(e.ptr);
    }
  }
  std::vector<int64_t> out(static_cast<size_t>(parts), 0);
  for (const auto& [ptr, tag_bytes] : live) {
    if (tag_bytes.first >= 0 && tag_bytes.first < parts) out[static_cast<size_t>(tag_bytes.first)] += tag_bytes.second;
  }
  return out;
}

// The observer of one run: opens and closes the parts as the model and autograd reach them.
// Held by a shared pointer: backward hooks on the run's tensors hold it weakly, so a tensor the
// model keeps past the run never calls into a recorder that is gone.
class PartRecorder final : public PartObserver, public std::enable_shared_from_this<PartRecorder> {
 public:
  PartRecorder(PartwiseModel& model, MemoryTracker& tracker, MemoryDevice device, bool hook_backward, bool watch_reads)
      : model_(model), tracker_(tracker), device_(device), hook_backward_(hook_backward), watch_reads_(watch_reads),
        count_(model.parts()), parameters_(model.parameters()) {
    for (const auto& t : model.batch_tensors()) batch_storages_.insert(storage_of(t));
    const auto n = static_cast<size_t>(count_);
    m_.run_live0 = tracker.current(device);
    m_.forward_seconds.assign(n, 0);
    m_.backward_seconds.assign(n, 0);
    m_.forward_peak.assign(n, 0);
    m_.block_forward_peak.assign(n, -1);
    m_.backward_peak.assign(n, 0);
    m_.forward_events.assign(n, {});
    m_.backward_events.assign(n, {});
    m_.output_bytes.assign(n, 0);
    m_.gradient_bytes.assign(n, 0);
    m_.kept_bytes.assign(n, 0);
    m_.output_alive.assign(n, false);
    m_.first_read_live.assign(n, -1);
    m_.input_copy_bytes.assign(n, 0);
    m_.backward_storages.assign(n, {});
    m_.state_changes.assign(n, "");
    m_.handed.assign(n, {});
    m_.block_output_bytes.assign(n, 0);
    m_.block_output_saved.assign(n, false);
    m_.block_output_alive.assign(n, false);
    watch_.resize(n);
    block_outputs_.resize(n);
    inputs_.assign(n, {});
  }

  void begin_forward() { start(0); }

  void enter(int part, const at::Tensor& input) override {
    if (part != open_ + 1) {
      if (!order_error_) order_error_ = std::make_pair(open_, part);
      return;
    }
    const int previous = open_;
    close_forward(previous);
    if (input.defined()) {
      m_.output_bytes[previous] = is_batch(input) ? 0 : tensor_bytes(input);
      inputs_[part] = storage_at(input);
      if (input.has_storage()) watch_[previous] = input.storage().getWeakStorageImpl();
      m_.input_copy_bytes[part] = model_.input_copy_bytes(part, input);
      if (hook_backward_ && input.requires_grad()) hook_input(part, input);
    }
    start(part);
  }

  bool watches_saved_reads() const override { return watch_reads_; }

  void block_returned(int part) override {
    if (part == open_) m_.block_forward_peak[part] = tracker_.peak(device_);
  }

  // Counted where a block's part made it: what the code before the first block makes (masks,
  // rotary tables) is that part's, which is never recomputed, and is counted there as it was.
  void handed(int part, const at::Tensor& tensor) override {
    const StorageAt s = storage_at(tensor);
    if (part < 0 || part >= count_ || s.data == nullptr || made_by_part(s.data) < 1) return;
    auto& held = m_.handed[part];
    if (std::none_of(held.begin(), held.end(), [&](const StorageAt& h) { return h.data == s.data; })) held.push_back(s);
  }

  void block_output(int part, const at::Tensor& output, bool saved) override {
    if (part < 0 || part >= count_ || !output.defined() || !output.has_storage()) return;
    m_.block_output_bytes[part] = tensor_bytes(output);
    m_.block_output_saved[part] = saved;
    block_outputs_[part] = output.storage().getWeakStorageImpl();
  }

  // The part whose forward allocated the storage at `data` in this run (kNoBlock: none did).
  int made_by_part(const void* data) const {
    const auto& events = tracker_.events();
    for (size_t i = events.size(); i-- > 0;) {
      const MemoryEvent& e = events[i];
      if (e.device == device_ && e.ptr == data && e.delta > 0) return e.block;
    }
    return kNoBlock;
  }

  void state_changed(int part, const std::string& what) override {
    if (part >= 0 && part < count_ && m_.state_changes[part].empty()) m_.state_changes[part] = what;
  }

  void saved_tensor_read(int part) override {
    if (part >= 0 && part < count_ && m_.first_read_live[part] < 0) m_.first_read_live[part] = tracker_.current(device_);
  }

  void end_forward(const at::Tensor& loss) {
    const int last = count_ - 1;
    if (open_ != last && !order_error_) order_error_ = std::make_pair(open_, last);
    close_forward(last);
    m_.output_bytes[last] = tensor_bytes(loss);
    if (loss.has_storage()) watch_[last] = loss.storage().getWeakStorageImpl();
    loss_ = storage_at(loss);
    tracker_.set_block(kNoBlock);
  }

  // After forward: what each part keeps, and whether its output is still alive.
  void note_end_of_forward() {
    m_.kept_bytes = live_bytes_by_tag(tracker_, device_, count_);
    for (int i = 0; i < count_; ++i) {
      m_.output_alive[i] = alive(watch_[i]);
      m_.block_output_alive[i] = alive(block_outputs_[i]);
    }
  }

  void begin_backward() { start_backward(count_ - 1, {}); }

  void end_backward() {
    close_backward();
    while (open_ > 0) start(open_ - 1);  // parts whose input needed no gradient ran their backward in the last one
    tracker_.set_block(kNoBlock);
  }

  // "blocks: expected each block to run once per forward, in order, ..." where they did not.
  void check_order() const {
    if (!order_error_) return;
    const auto [done, wanted] = *order_error_;
    throw std::invalid_argument("blocks: expected each block to run once per forward, in order, but " +
                                model_.part_name(wanted) + " came after " + model_.part_name(done) +
                                "; `blocks` must be modules that run one after another");
  }

  PartsMeasured take() {
    m_.input_storages = inputs_;
    return std::move(m_);
  }

 private:
  void start(int part) {
    open_ = part;
    tracker_.set_block(static_cast<int16_t>(part));
    tracker_.reset_peak();
    live0_ = tracker_.current(device_);
    first_event_ = tracker_.events().size();
    t0_ = ProfileClock::now();
  }
  EventSpan events() const { return {first_event_, tracker_.events().size(), live0_, true}; }

  void close_forward(int part) {
    m_.forward_seconds[part] = seconds_since(t0_);
    m_.forward_peak[part] = tracker_.peak(device_);
    m_.forward_events[part] = events();
  }

  void close_backward() {
    const int part = open_;
    m_.backward_seconds[part] = seconds_since(t0_);
    m_.backward_peak[part] = tracker_.peak(device_);
    m_.backward_events[part] = events();
    for (const auto& p : parameters_) {
      if (p.grad().defined() && seen_gradients_.insert(p.unsafeGetTensorImpl()).second) {
        m_.gradient_bytes[part] += static_cast<int64_t>(p.nbytes());
      }
    }
  }

  // The gradient of part `part`'s input is complete: its backward is done, and that gradient is
  // the one arriving for the previous part's output.
  void hook_input(int part, const at::Tensor& input) {
    std::weak_ptr<PartRecorder> self = weak_from_this();
    const_cast<at::Tensor&>(input).register_hook([self, part](const at::Tensor& gradient) {
      if (auto recorder = self.lock(); recorder && recorder->open_ >= part) {
        recorder->close_backward();
        recorder->start_backward(part - 1, storage_at(gradient));
      }
    });
  }

  // Part `part`'s backward starts, with `gradient` arriving for its output: which of the
  // storages it could hold past its use are alive now.
  void start_backward(int part, StorageAt gradient) {
    BackwardStorages& s = m_.backward_storages[part];
    s.gradient = gradient;
    s.output = part + 1 < count_ ? inputs_[part + 1] : loss_;
    s.output_alive = alive(watch_[part]);
    s.input = inputs_[part];
    s.input_alive = part > 0 && alive(watch_[part - 1]);
    start(part);
  }

  static bool alive(const std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>& watch) {
    return watch.has_value() && !watch->expired();
  }

  // The first part's input taken from the batch as it is: counted as the batch's bytes, and no
  // gradient comes back for it.
  bool is_batch(const at::Tensor& t) const { return !t.requires_grad() && batch_storages_.count(storage_of(t)) > 0; }

  PartwiseModel& model_;
  MemoryTracker& tracker_;
  MemoryDevice device_;
  bool hook_backward_, watch_reads_;
  int count_;
  std::vector<at::Tensor> parameters_;
  std::unordered_set<const void*> batch_storages_;
  PartsMeasured m_;
  std::vector<std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>> watch_;  // each part's output
  std::vector<std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>> block_outputs_;  // each block's own
  std::vector<StorageAt> inputs_;  // each part's input
  StorageAt loss_;
  std::unordered_set<const c10::TensorImpl*> seen_gradients_;
  int open_ = 0;
  int64_t live0_ = 0;
  size_t first_event_ = 0;
  ProfileClock::time_point t0_;
  std::optional<std::pair<int, int>> order_error_;
};

// Hooks that keep one parameter's gradient at a time, as the offloaded optimizer streams them
// (runtime/optimizer_offload.h): each one released at the next one's hook. Removed on scope exit.
class StreamedGradients {
 public:
  explicit StreamedGradients(std::vector<at::Tensor> parameters) : parameters_(std::move(parameters)) {
    auto stored = std::make_shared<at::Tensor>();  // the parameter whose gradient is kept
    for (auto& p : parameters_) {
      at::Tensor parameter = p;  // (a reference the hook holds until it is removed)
      handles_.push_back(p.register_hook([stored, parameter](const at::Tensor& grad) {
        if (stored->defined()) stored->mutable_grad().reset();
        *stored = parameter;
        return grad;
      }));
    }
  }
  ~StreamedGradients() {
    for (size_t i = 0; i < parameters_.size(); ++i) parameters_[i].remove_hook(handles_[i]);
  }
  StreamedGradients(const StreamedGradients&) = delete;
  StreamedGradients& operator=(const StreamedGradients&) = delete;

 private:
  std::vector<at::Tensor> parameters_;
  std::vector<unsigned> handles_;
};

// The tracker records the run; the tag and the gradients are put back however it ends.
struct RunScope {
  PartwiseModel& model;
  MemoryTracker& tracker;
  explicit RunScope(PartwiseModel& m, MemoryTracker& t) : model(m), tracker(t) {
    TORCH_CHECK(!tracker.recording(), "memfit: the profile records the tracker's events itself");
    tracker.start_recording();
  }
  ~RunScope() {
    tracker.stop_recording();
    tracker.set_block(kNoBlock);
    release_gradients(model);
  }
};

// Waits for the device's queued kernels, so that a clock read after them counts them.
void synchronize(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index() < 0 ? 0 : device.index());
}

}  // namespace

void release_gradients(PartwiseModel& model) { zero_grad(model.parameters(), true); }

PartsMeasured measure_parts(PartwiseModel& model, MemoryTracker& tracker, MemoryDevice device, const PartRun& run,
                            PartRunKind kind) {
  release_gradients(model);  // (a timing run leaves some)
  if (kind == PartRunKind::kAccumulating) {
    at::NoGradGuard no_grad;
    for (auto& p : model.parameters()) p.mutable_grad() = at::zeros_like(p);
  }
  std::optional<StreamedGradients> streamed;
  if (kind == PartRunKind::kStreamed) streamed.emplace(model.parameters());
  auto recorder = std::make_shared<PartRecorder>(model, tracker, device, true, kind == PartRunKind::kAccumulating);
  RunScope scope(model, tracker);
  at::Tensor loss;
  {
    PhaseGuard phase(Phase::kForward);
    recorder->begin_forward();
    loss = model.forward(run, recorder.get());
    recorder->end_forward(loss);
  }
  recorder->check_order();
  recorder->note_end_of_forward();
  {
    PhaseGuard phase(Phase::kBackward);
    recorder->begin_backward();
    loss.backward();
    recorder->end_backward();
  }
  model.mark_warm(run);
  return recorder->take();
}

PartsMeasured measure_parts_nograd(PartwiseModel& model, MemoryTracker& tracker, MemoryDevice device,
                                   const PartRun& run) {
  release_gradients(model);
  auto recorder = std::make_shared<PartRecorder>(model, tracker, device, false, false);
  RunScope scope(model, tracker);
  PartRun segment = run;
  segment.blocks_without_grad = true;
  PhaseGuard phase(Phase::kForward);
  recorder->begin_forward();
  at::Tensor loss = model.forward(segment, recorder.get());
  recorder->end_forward(loss);
  recorder->note_end_of_forward();  // what each part keeps in a segment: the code around its block
  recorder->check_order();
  loss = at::Tensor();
  return recorder->take();
}

double time_parts(PartwiseModel& model, const PartRun& run) {
  if (run.samples >= model.samples()) {
    release_gradients(model);
  } else {
    at::NoGradGuard no_grad;
    for (auto& p : model.parameters()) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    }
  }
  const auto t0 = ProfileClock::now();
  at::Tensor loss;
  {
    PhaseGuard phase(Phase::kForward);
    loss = model.forward(run, nullptr);
  }
  {
    PhaseGuard phase(Phase::kBackward);
    loss.backward();
  }
  synchronize(model.device());
  model.mark_warm(run);
  return seconds_since(t0);
}

double time_forward(PartwiseModel& model, const PartRun& run) {
  const auto t0 = ProfileClock::now();
  {
    PhaseGuard phase(Phase::kForward);
    at::Tensor loss = model.forward(run, nullptr);
  }
  synchronize(model.device());
  return seconds_since(t0);
}

}  // namespace memfit
