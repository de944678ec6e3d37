// Measuring one block of a chain alone, as a chain runs it (profile.h: profile_chain).
#include "plan/profile_block.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "memfit/compat.h"
#include "memfit/errors.h"
#include "memfit/runtime/step.h"
#include "memfit/techniques/grads.h"
#include "memfit/techniques/rng.h"

namespace memfit {
namespace {

using Clock = ProfileClock;


// "profiling at micro-batch 8 (backward)": what errors inside a profiled block say ran.
std::string profiling_phase(const at::Tensor& x, const char* part = "") {
  return "profiling at micro-batch " + std::to_string(x.dim() > 0 ? x.size(0) : 1) + part;
}

// Records the tracker's events for a scope, unless a caller already does (its recording is left
// alone, and the scope's moments are not known). `device`: the counted device of the block's run.
class Recording {
 public:
  Recording(MemoryTracker& tracker, MemoryDevice device)
      : tracker_(tracker), device_(device), own_(!tracker.recording()) {
    if (own_) tracker_.start_recording();
  }
  ~Recording() { stop(); }
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;

  bool own() const { return own_; }
  void stop() {
    if (own_ && tracker_.recording()) tracker_.stop_recording();
  }
  // The moments of the peak the scope measured: `peak` bytes above `live`.
  PeakMoments moments(int64_t live, int64_t peak) {
    stop();
    const auto& events = tracker_.events();
    return own_ ? peak_moments(events, 0, events.size(), device_, live, live, peak) : PeakMoments{};
  }

 private:
  MemoryTracker& tracker_;
  MemoryDevice device_;
  bool own_;
};

// The input of one profiled run of block i: a copy where the block may write into its input
// (x is the input of its next run too, and of the next block's).
at::Tensor input_for_run(const Chain& chain, int i, const at::Tensor& x) {
  at::NoGradGuard no_grad;
  return chain.may_write_input(i) ? x.clone() : x;
}

// The forward without grad, as inside a checkpointed segment (which copies the input of a first
// block that writes into it: input_copy_bytes, counted by the schedule).
// Its output is the next block's input (the runs with grad keep nothing of theirs alive).
void run_forward_nograd(Chain& chain, int i, const at::Tensor& x, Precision precision, MemoryTracker& tracker,
                        BlockRun& r) {
  at::NoGradGuard no_grad;
  const at::Tensor xin = input_for_run(chain, i, x);
  Autocast autocast(x.device().type(), precision);
  const MemoryDevice device = memory_device_of(x.device());
  const int64_t live0 = tracker.current(device);
  tracker.reset_peak();
  Recording recording(tracker, device);
  const auto t0 = Clock::now();
  at::Tensor y = chain.run_block(i, xin, profiling_phase(x).c_str());
  r.forward_nograd_seconds = seconds_since(t0);
  r.cost.forward_nograd_peak = tracker.peak(device) - live0;
  r.moments.forward_nograd = recording.moments(live0, r.cost.forward_nograd_peak);
  r.cost.input_copy_bytes = chain.may_write_input(i) ? static_cast<int64_t>(x.nbytes()) : 0;  // (a copy is dense)
  if (i + 1 < chain.size()) r.next_input = y;
}

// The identity as the first node of a block's graph: its output is the block's input as in a
// chain (a tensor of the graph, not a leaf, held by nothing but the graph once the caller lets
// go, so it is freed where the block's backward is done with it), and the gradient arriving
// for it ends here, freed as the previous block's backward would free it. `anchor` (a scalar
// leaf) only makes the output require grad.
class ChainInput : public torch::autograd::Function<ChainInput> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& data, const at::Tensor& anchor) {
    (void)anchor;
    return data.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    return {at::Tensor(), at::Tensor()};
  }
};

// A copy of x as block i finds its input in a chain (ChainInput), where floating point.
at::Tensor chain_input(const at::Tensor& x) {
  at::Tensor copy;
  {
    at::NoGradGuard no_grad;
    copy = x.clone();
  }
  if (!x.is_floating_point()) return copy;
  return ChainInput::apply(copy, at::zeros({}, x.options()).requires_grad_(true));
}

// Whether the block's graph keeps its output's storage for the block's own backward (a last op
// that saves its result: ReLU(inplace=True), sigmoid, softmax): references to that storage
// besides the profile's own. For an output on the input's storage, those the forward added
// (`before`: the storage's references then) less the output's own where it is a new tensor on
// it (a view); otherwise all but the output's, and a view's base that only the view holds.
bool graph_keeps_output(const at::Tensor& output, const at::Tensor& input, int64_t before, bool output_is_input) {
  const auto refs = static_cast<int64_t>(output.storage().use_count());
  if (output_is_input) return refs - before - (output.is_same(input) ? 0 : 1) > 0;
  if (!output.is_view()) return refs > 1;
  const at::TensorBase& base = output._base();  // held by the view
  return base.use_count() > 1 || refs > 2;
}

// A scalar after `out` whose backward gives `out` a gradient of ones, made inside backward and
// freed once used, as the next block's backward makes it in a chain (a gradient passed to
// backward() would live through all of it).
class OnesGradient : public torch::autograd::Function<OnesGradient> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out) {
    ctx->saved_data["sizes"] = out.sizes().vec();
    ctx->saved_data["like"] = at::empty({0}, out.options());  // (no bytes)
    return at::zeros({}, out.options());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list) {
    return {at::ones(ctx->saved_data["sizes"].toIntVector(), ctx->saved_data["like"].toTensor().options())};
  }
};

// A storage known by its address and size only (a reference would keep it alive).
struct StorageAt {
  const void* data = nullptr;
  int64_t bytes = 0;
};
StorageAt storage_at(const at::Tensor& t) { return {t.storage().data(), static_cast<int64_t>(t.storage().nbytes())}; }

// Peaks of one measured backward above the live bytes at its start, as in a plain chain: the
// gradient arriving for the block's output, its output and its input each freed once the
// graph is done with them. And what holding some of them to the end adds: its input (kept by
// the block before, or a segment's saved input); the gradient and the output (a checkpointed
// segment's last block: the segment holds both until its backward returns); all three.
struct BackwardPeaks {
  int64_t freed = 0;
  int64_t input_held = 0, segment_end = 0, segment_end_input_held = 0;  // added to `freed`
  // Of the whole peaks (freed, and freed with the addition): BlockMoments' backward fields.
  PeakMoments freed_moments, input_held_moments, segment_end_moments, all_moments;
};

// From the recorded events of one backward: the peaks had those storages not been freed. The
// gradient is the first allocation of `gradient_bytes` (OnesGradient's). An output or input
// that nothing held was freed before backward began, and its address may then come back for
// another storage (the gradient, of the output's size): an allocation there means the storage
// is gone, and later frees there are not its.
BackwardPeaks held_peaks(const std::vector<MemoryEvent>& events, MemoryDevice device, int64_t live,
                         int64_t gradient_bytes, const StorageAt& output, const StorageAt& input, int64_t freed) {
  const void* gradient = nullptr;
  int64_t g = 0, o = 0, in = 0;  // bytes freed so far of each
  int64_t input_held = 0, segment_end = 0, all = 0;
  bool output_alive = output.data != nullptr && output.data != input.data, input_alive = input.data != nullptr;
  PeakMomentsRecorder freed_moments, input_held_moments, segment_end_moments, all_moments;
  for (const MemoryEvent& e : events) {
    if (e.device != device) continue;  // (the peak is the run's device's)
    if (gradient == nullptr && e.delta == gradient_bytes) gradient = e.ptr;
    if (e.delta > 0 && e.ptr == output.data) output_alive = false;
    if (e.delta > 0 && e.ptr == input.data) input_alive = false;
    if (e.delta < 0 && e.ptr == gradient) g = gradient_bytes;
    if (e.delta < 0 && input_alive && e.ptr == input.data) {
      in = input.bytes;
      input_alive = false;
    }
    if (e.delta < 0 && output_alive && e.ptr == output.data) {
      o = output.bytes;
      output_alive = false;
    }
    const int64_t at = e.live - live;
    input_held = std::max(input_held, at + in);
    segment_end = std::max(segment_end, at + g + o);
    all = std::max(all, at + g + o + in);
    freed_moments.add(e, at);
    input_held_moments.add(e, at + in);
    segment_end_moments.add(e, at + g + o);
    all_moments.add(e, at + g + o + in);
  }
  const auto above = [freed](int64_t peak) { return std::max<int64_t>(0, peak - freed); };
  return {freed,
          above(input_held),
          above(segment_end),
          above(all),
          freed_moments.take(freed),
          input_held_moments.take(input_held),
          segment_end_moments.take(segment_end),
          all_moments.take(all)};
}

// Backward from `out` (its gradient all ones, made inside: OnesGradient), `output` and `input`
// being the block's output and input storages: its seconds and its peaks. An error comes out naming the block and
// the phase.
double measured_backward(const Chain& chain, int i, const at::Tensor& x, at::Tensor out, const StorageAt& output,
                         const StorageAt& input, MemoryTracker& tracker, BackwardPeaks& peaks) {
  const auto gradient_bytes = static_cast<int64_t>(out.numel() * out.element_size());
  const MemoryDevice device = memory_device_of(out.device());
  at::Tensor root = OnesGradient::apply(out);
  out = at::Tensor();
  const int64_t live = tracker.current(device);
  tracker.reset_peak();
  Recording recording(tracker, device);
  const auto t0 = Clock::now();
  try {
    root.backward();
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    throw compat::error_without_backtrace(chain.describe_block(i) + ", " + profiling_phase(x, " (backward)") + ": " +
                                          error_cause(e.what_without_backtrace()));
  }
  const double seconds = seconds_since(t0);
  recording.stop();
  const int64_t freed = tracker.peak(device) - live;
  const int64_t g = gradient_bytes, o = output.bytes, in = input.bytes;
  peaks = recording.own() ? held_peaks(tracker.events(), device, live, gradient_bytes, output, input, freed)
                          : BackwardPeaks{freed, in, g + o, g + o + in, {}, {}, {}, {}};
  return seconds;
}

// The block's forward with grad on its input as a chain gives it (chain_input: not a leaf);
// the last block carries the loss.
at::Tensor forward_with_grad(Workload& w, int i, const at::Tensor& xi, const at::Tensor& x, const at::Tensor& target,
                             Precision precision, at::Tensor* block_output = nullptr) {
  Autocast autocast(x.device().type(), precision);
  at::Tensor y = w.chain->run_block(i, xi, profiling_phase(x).c_str());
  if (block_output != nullptr) *block_output = y;
  return i == w.chain->size() - 1 ? w.loss(y, target) : y;
}

// Forward + backward with grad (the chain ran before: warm), as a step's first micro-batch
// does: the block's gradients are made by its backward. Nothing here holds the block's input
// or output during backward: what the block's graph keeps is freed as in a chain.
void run_forward_backward(Workload& w, int i, const at::Tensor& x, const at::Tensor& target, Precision precision,
                          MemoryTracker& tracker, BlockRun& r) {
  Chain& chain = *w.chain;
  BlockCost& c = r.cost;
  const bool last = i == chain.size() - 1;
  zero_grad(chain.block(i).module->parameters(), true);  // (the calibration run left them)
  at::Tensor xi = chain_input(x);
  const StorageAt input = storage_at(xi);
  const auto uses = xi.use_count();
  const auto storage_uses = static_cast<int64_t>(xi.storage().use_count());
  const MemoryDevice device = memory_device_of(x.device());
  const int64_t live0 = tracker.current(device);
  tracker.reset_peak();
  Recording recording(tracker, device);
  const auto t0 = Clock::now();
  at::Tensor y;
  at::Tensor out = forward_with_grad(w, i, xi, x, target, precision, &y);
  c.forward_seconds = seconds_since(t0);
  c.forward_peak = tracker.peak(device) - live0;
  r.moments.forward = recording.moments(live0, c.forward_peak);
  r.output_is_input = !last && y.is_alias_of(xi);
  r.kept_input = xi.use_count() > uses || static_cast<int64_t>(xi.storage().use_count()) > storage_uses;
  c.keeps_own_output = !last && graph_keeps_output(y, xi, storage_uses, r.output_is_input);
  const StorageAt output = storage_at(y);
  y = at::Tensor();
  xi = at::Tensor();
  c.output_bytes = static_cast<int64_t>(out.storage().nbytes());
  // Internal bytes: without an output this forward allocated.
  c.kept_bytes = tracker.current(device) - live0 - (r.output_is_input ? 0 : c.output_bytes);
  BackwardPeaks peaks;
  c.backward_seconds = measured_backward(chain, i, x, std::move(out), output, input, tracker, peaks);
  c.backward_peak = peaks.freed;
  c.backward_held_input_bytes = peaks.input_held;
  c.backward_held_by_segment_bytes = peaks.segment_end;
  c.backward_held_all_bytes = peaks.segment_end_input_held;
  r.moments.backward = std::move(peaks.freed_moments);
  r.moments.backward_input_held = std::move(peaks.input_held_moments);
  r.moments.backward_segment_end = std::move(peaks.segment_end_moments);
  r.moments.backward_all = std::move(peaks.all_moments);
}

// Backward again, adding into the gradients the run before made, as a step's later micro-batches
// do: only its temporaries (and each parameter's new gradient, until added) come and go.
void run_backward_accumulating(Workload& w, int i, const at::Tensor& x, const at::Tensor& target, Precision precision,
                               MemoryTracker& tracker, BlockRun& r) {
  at::Tensor xi = chain_input(x);
  const StorageAt input = storage_at(xi);
  at::Tensor y;
  at::Tensor out = forward_with_grad(w, i, xi, x, target, precision, &y);
  const StorageAt output = storage_at(y);
  xi = at::Tensor();
  y = at::Tensor();
  BackwardPeaks peaks;
  measured_backward(*w.chain, i, x, std::move(out), output, input, tracker, peaks);
  r.cost.backward_peak_accumulating = peaks.freed;
  r.moments.backward_accumulating = std::move(peaks.freed_moments);
  zero_grad(w.chain->block(i).module->parameters(), true);
}

}  // namespace

// Block i alone on input x (detached): its forward without grad (as inside a checkpointed
// segment), then forward + backward with grad, its gradients made, then added into.
BlockRun run_block(Workload& w, int i, const at::Tensor& x, const at::Tensor& target, Precision precision,
                   MemoryTracker& tracker) {
  const Block& block = w.chain->block(i);
  BlockRun r;
  BlockCost& c = r.cost;
  // The parameter's own bytes, not its storage's: at ZeRO 3 a block's parameters are views of
  // one flat buffer. A tensor later blocks hold too has its gradient made by the last of them.
  const auto params = w.chain->parameters();
  const auto owners = w.chain->parameter_blocks();
  for (size_t k = 0; k < params.size(); ++k) {
    if (owners[k] == i) c.param_bytes += static_cast<int64_t>(params[k].nbytes());
  }
  if (precision != Precision::kFP32) {
    const int64_t element = static_cast<int64_t>(c10::elementSize(precision_dtype(precision)));
    for (const auto& p : autocast_cast_parameters(*block.module)) c.cast_bytes += p.numel() * element;
  }
  run_forward_nograd(*w.chain, i, x, precision, tracker, r);
  run_forward_backward(w, i, x, target, precision, tracker, r);
  run_backward_accumulating(w, i, x, target, precision, tracker, r);
  c.input_copy_kept = c.input_copy_bytes > 0 && r.kept_input && !r.output_is_input;
  c.output_kept = i == w.chain->size() - 1 || c.keeps_own_output;  // the loss lives until backward;
  return r;                                                         // others: also when the next block keeps it
}

namespace {

// The previous block's output, as the block run next (r) finds it: kept when r keeps it; an
// output of r on the same storage takes it over (and keeps it where the previous block's graph
// does), so the storage is counted once.
void hand_on_output(BlockCost& previous, BlockRun& r) {
  if (!r.output_is_input) {
    previous.output_kept = previous.output_kept || r.kept_input;
    return;
  }
  r.cost.output_kept = r.cost.output_kept || previous.output_kept;
  previous.output_kept = false;
}

// A parameter several blocks hold (tied weights): backward sums its gradient's parts before
// adding them in, so the part the last holder makes waits from that block's backward until the
// first holder's is done: alive in the backward of every block from the first holder up to the
// last, when gradients are already there (a step's later micro-batches).
void add_shared_gradients(const Chain& chain, ChainProfile& prof) {
  std::unordered_map<const c10::TensorImpl*, std::pair<int, int>> holders;  // first, last
  std::unordered_map<const c10::TensorImpl*, int64_t> bytes;
  for (int i = 0; i < chain.size(); ++i) {
    for (const auto& p : chain.block(i).module->parameters()) {
      auto [it, fresh] = holders.emplace(p.unsafeGetTensorImpl(), std::make_pair(i, i));
      it->second.second = i;
      bytes[p.unsafeGetTensorImpl()] = static_cast<int64_t>(p.nbytes());
    }
  }
  for (const auto& [impl, range] : holders) {
    for (int k = range.first; k < range.second; ++k) prof.blocks[static_cast<size_t>(k)].shared_gradient_bytes += bytes[impl];
  }
}

}  // namespace

ChainProfile profile_chain(Workload& w, const Batch& batch, int64_t m, Precision precision, MemoryTracker& tracker) {
  ChainProfile prof;
  prof.micro_batch = m;
  const Batch part = batch.slice(0, m);
  // Dropout draws must not disturb the caller's random stream.
  const RngState rng = capture_rng(part.input.device());
  at::Tensor x = part.input;
  for (int i = 0; i < w.chain->size(); ++i) {
    BlockRun r = run_block(w, i, x, part.target, precision, tracker);
    if (i > 0) hand_on_output(prof.blocks.back(), r);
    prof.blocks.push_back(r.cost);
    prof.moments.push_back(std::move(r.moments));
    prof.forward_nograd_seconds += r.forward_nograd_seconds;
    x = r.next_input;
  }
  for (auto& c : prof.blocks) {
    if (c.output_kept) c.kept_bytes += c.output_bytes;
  }
  add_shared_gradients(*w.chain, prof);
  restore_rng(rng);
  return prof;
}

}  // namespace memfit
