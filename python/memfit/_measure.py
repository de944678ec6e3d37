"""One instrumented run of the user's step at one micro-batch size and precision: each part
of the chain measured where it runs, with the C++ tracker's exact bytes.

The chain is: part 0, the code before the first block (embeddings, masks); parts 1..N, the
blocks; part N+1, the code after the last block and the loss. A part starts when its input
(the previous block's output, or the first block's input) enters it. Forward: its seconds, its
peak above the live bytes at its start, its output's bytes, what it leaves alive for backward
(allocations tagged with the part, alive at the end of forward), and whether its output is kept.
Backward: a hook on each part's input fires when that part's backward is done, so each part's
backward seconds, peak and the gradients of parameters it makes are measured too.
"""
import contextlib
import time

import torch

from memfit import _batch, _calls, _storage
from memfit._loader import load
from memfit._phases import phase, set_tag

_C = load()

def autocast(device, precision):
    """torch.autocast for a precision name ("fp32": a context that does nothing)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


def scalar_loss(loss):
    """The loss, checked: one number in a tensor; ValueError otherwise."""
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss_fn returned {type(loss).__name__}: expected a scalar tensor (the loss of the batch)")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn returned a tensor of shape {list(loss.shape)}: expected a scalar (one number, "
                         "e.g. the mean over the batch)")
    if not loss.is_floating_point():
        raise ValueError(f"loss_fn returned a {loss.dtype} tensor: expected a floating-point scalar")
    return loss.reshape(())


def _tensor_bytes(t):
    """A tensor's own bytes (a view of a larger storage, such as a micro-batch, counts its part)."""
    return min(_storage.storage_bytes(t), t.numel() * t.element_size())


class _Parts:
    """The measurements of the chain's parts during one run."""

    def __init__(self, tracker, count, parameters, batch):
        self.tracker = tracker
        self.batch_storages = {_storage.storage_key(t) for t in _batch.tensors(batch)}
        self.count = count
        self.parameters = parameters
        self.run_live0 = tracker.current()  # live bytes when the run starts
        self.fwd_seconds = [0.0] * count
        self.fwd_peak = [0] * count  # the highest live bytes during each part's forward (absolute)
        self.out_bytes = [0] * count
        self.watch = [None] * count
        self.bwd_seconds = [0.0] * count
        self.bwd_peak = [0] * count  # ... and during its backward
        # Each part's recorded events (first, last) and live bytes at its start, forward and
        # backward: its peaks' moments (plan/peak_moments.h)
        self.fwd_events = [None] * count
        self.bwd_events = [None] * count
        self.grad_ids = [set() for _ in range(count)]
        self.open = 0
        self.order_error = None
        self.highest = 0  # the run's peak: the highest of the parts' peaks, in live bytes
        self._seen_grads = set()
        # Live bytes at each block's backward's first read of a tensor its forward saved (where
        # a non-reentrant checkpoint recomputes), recorded by saved_tensor_reads.
        self.first_read_live = [None] * count

    def saved_tensor_reads(self, part):
        """Saved-tensor hooks for part `part`'s forward that note the live bytes at its
        backward's first read (the tensors themselves pass through unchanged)."""
        def read(packed):
            if self.first_read_live[part] is None:
                self.first_read_live[part] = self.tracker.current()
            return packed
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, read)

    def _peak(self):
        peak = self.tracker.peak()
        self.highest = max(self.highest, peak)
        return peak

    def _start(self, part):
        self.open = part
        set_tag(part)
        self.tracker.reset_peak()
        self.live0 = self.tracker.current()
        self.first_event = self.tracker.event_count()
        self.t0 = time.perf_counter()

    def _events(self):
        return (self.first_event, self.tracker.event_count(), self.live0)

    def begin_forward(self):
        self._start(0)

    def enter(self, part, tensor, hook_backward):
        """Part `part` starts on `tensor` (the previous part's output)."""
        if part != self.open + 1:
            self.order_error = self.order_error or (self.open, part)
            return
        previous = self.open
        self.fwd_seconds[previous] = time.perf_counter() - self.t0
        self.fwd_peak[previous] = self._peak()
        self.fwd_events[previous] = self._events()
        if tensor is not None:
            self.out_bytes[previous] = 0 if self._is_batch(tensor) else _tensor_bytes(tensor)
            self.watch[previous] = _C.StorageWatch(tensor)
            if hook_backward and tensor.requires_grad:
                tensor.register_hook(self._backward_hook(part))
        self._start(part)

    def _is_batch(self, tensor):
        """The first block's input taken from the batch as it is: counted as the batch's bytes,
        and no gradient comes back for it (the CLI's chain input, likewise)."""
        return not tensor.requires_grad and _storage.storage_key(tensor) in self.batch_storages

    def end_forward(self, loss):
        last = self.count - 1
        if self.open != last:
            self.order_error = self.order_error or (self.open, last)
        self.fwd_seconds[last] = time.perf_counter() - self.t0
        self.fwd_peak[last] = self._peak()
        self.fwd_events[last] = self._events()
        self.out_bytes[last] = _tensor_bytes(loss)

    def begin_backward(self):
        self._start(self.count - 1)

    def _close_backward(self):
        part = self.open
        self.bwd_seconds[part] = time.perf_counter() - self.t0
        self.bwd_peak[part] = self._peak()
        self.bwd_events[part] = self._events()
        for p in self.parameters:
            if p.grad is not None and id(p) not in self._seen_grads:
                self._seen_grads.add(id(p))
                self.grad_ids[part].add(id(p))

    def _backward_hook(self, part):
        def hook(grad):
            # The gradient of part `part`'s input is complete: its backward is done.
            if self.open >= part:
                self._close_backward()
                self._start(part - 1)
        return hook

    def end_backward(self):
        self._close_backward()
        while self.open > 0:  # parts whose input needed no gradient ran their backward in the last one
            self._start(self.open - 1)


class ChainRunner:
    """Runs loss_fn(model, micro-batch) with the blocks' calls seen, as the profile needs."""

    def __init__(self, model, loss_fn, blocks, device):
        self.model, self.loss_fn, self.blocks, self.device = model, loss_fn, blocks, device
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.parts = len(blocks) + 2

    def _handler(self, parts, hook_backward, watch_reads):
        last = len(self.blocks) - 1

        def handler(index, args, kwargs, run):
            where = _calls.main_input(args, kwargs)
            x = _calls.get_input(args, kwargs, where) if where else None
            parts.enter(index + 1, x, hook_backward)
            with parts.saved_tensor_reads(index + 1) if watch_reads else contextlib.nullcontext():
                out = run(args, kwargs)
            if index == last:
                parts.enter(index + 2, _calls.main_output(out), hook_backward)
            return out
        return handler

    def _forward(self, parts, batch, precision, hook_backward, watch_reads=False):
        intercept = _calls.Intercept(self.blocks, self._handler(parts, hook_backward, watch_reads))
        try:
            with phase("forward"), autocast(self.device, precision):
                parts.begin_forward()
                loss = scalar_loss(self.loss_fn(self.model, batch))
                parts.end_forward(loss)
        finally:
            intercept.remove()
            set_tag(-1)
        self._check_order(parts)
        return loss

    def _check_order(self, parts):
        if parts.order_error is None:
            return
        done, wanted = parts.order_error
        names = ["(code before the first block)"] + [b.name for b in self.blocks] + ["(code after the last block)"]
        raise ValueError(f"blocks: expected each block to run once per forward, in order, but {names[wanted]} "
                         f"came after {names[done]}; pass blocks= modules that run one after another")

    def _stream_gradients(self):
        """Hooks that keep one parameter's gradient at a time, as the offloaded optimizer streams
        them (runtime/optimizer_offload.h): each one released at the next one's hook."""
        stored = []

        def hook_for(p):
            def hook(grad):
                for q in stored:
                    q.grad = None
                stored[:] = [p]
                return grad
            return hook
        return [p.register_hook(hook_for(p)) for p in self.parameters]

    def measure(self, tracker, batch, precision, accumulating=False, streamed=False):
        """Forward + backward of one micro-batch: each part's measurements, and the run's peak
        above the bytes live at its start. accumulating: as a step's later micro-batches run,
        every gradient there before (zeros, made first) and added into; its blocks' first
        reads of saved tensors are watched (parts.first_read_live), its seconds not used.
        streamed: each gradient released once the next is made (the optimizer offloaded)."""
        if accumulating:
            for p in self.parameters:
                p.grad = torch.zeros_like(p)
        hooks = self._stream_gradients() if streamed else []
        parts = _Parts(tracker, self.parts, self.parameters, batch)
        tracker.start_recording()
        try:
            loss = self._forward(parts, batch, precision, hook_backward=True, watch_reads=accumulating)
            kept = tracker.live_bytes_by_tag(self.parts)
            output_kept = [w is not None and w.alive() for w in parts.watch]
            with phase("backward"):
                parts.begin_backward()
                loss.backward()
                parts.end_backward()
        finally:
            tracker.stop_recording()
            set_tag(-1)
            for h in hooks:
                h.remove()
            for p in self.parameters:
                p.grad = None
        return parts, kept, output_kept

    def measure_nograd(self, tracker, batch, precision):
        """Forward without grad (as inside a checkpointed segment): each part's peak and seconds."""
        parts = _Parts(tracker, self.parts, self.parameters, batch)
        tracker.start_recording()
        try:
            with torch.no_grad():
                self._forward(parts, batch, precision, hook_backward=False)
        finally:
            tracker.stop_recording()
        return parts

