"""Checkpointed segments of blocks: forward keeps only the segment's input, backward recomputes
the segment and hands autograd the tensors it saved.

Non-reentrant, as torch.utils.checkpoint(use_reentrant=False): forward builds the graph as
usual but every tensor autograd saves inside the segment's blocks is replaced by a handle
(saved-tensor hooks); the first handle backward unpacks runs the segment again and returns the
recomputed tensors. Gradients are then the plain step's, bit for bit: the same graph computes
them from equal values. As memfit's C++ checkpoint (techniques/checkpoint.h) does, the
recompute runs under the forward's random state (dropout draws the same masks) and autocast
state, and buffers (BatchNorm's running statistics) are put back after it, so a batch counts
once. Unlike torch's checkpoint, a segment may span blocks called one by one by the model's own
code (a ModuleList's loop, with extra arguments such as an attention mask): each block's call is
recorded and replayed, the next block's input being the previous one's recomputed output.
"""
import contextlib
import weakref

import torch

from memfit import _calls
from memfit._loader import load
from memfit._phases import phase

_C = load()


def _autocast_state():
    """(device type, enabled, dtype) for the CPU and, where there is one, CUDA."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    state = []
    for device in devices:
        if hasattr(torch, "get_autocast_dtype"):  # 2.4+
            state.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
        elif device == "cpu":
            state.append((device, torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()))
        else:
            state.append((device, torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()))
    return state


def _autocast_contexts(stack, state, cache_enabled=True, only_enabled=False):
    for device, enabled, dtype in state:
        if enabled or not only_enabled:
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype, enabled=enabled,
                                               cache_enabled=cache_enabled))


class _Handle:
    """What a saved tensor is replaced by: owned by autograd's SavedVariable alone, so the
    recomputed tensor kept for it goes as soon as autograd lets go of the handle."""

    __slots__ = ("recording", "__weakref__")

    def __init__(self, recording):
        self.recording = recording


class _Detached:
    """A tensor a recording keeps for the recompute, detached from the graph: the recording is
    owned by the handles in that graph, so a tensor of it kept here would make a cycle through
    autograd's C++ nodes that Python's collector cannot see (a step failing mid-segment would
    then leak the segment's graph for good). Attached again as a leaf requiring grad as it did."""

    __slots__ = ("tensor", "requires_grad")

    def __init__(self, tensor):
        self.tensor, self.requires_grad = tensor.detach(), tensor.requires_grad

    def attached(self):
        return self.tensor.detach().requires_grad_(self.requires_grad)


def _detach_tensors(value):
    """`value` with its tensors (in tuples and lists too) as _Detached, for a recording to keep."""
    if isinstance(value, torch.Tensor):
        return _Detached(value)
    if type(value) in (tuple, list):
        return type(value)(_detach_tensors(v) for v in value)
    return value


def _attach_tensors(value):
    """The reverse of _detach_tensors, for a replay."""
    if isinstance(value, _Detached):
        return value.attached()
    if type(value) in (tuple, list):
        return type(value)(_attach_tensors(v) for v in value)
    return value


class _Recording:
    """One forward of a segment: what its recompute needs, and the tensors recomputed. It keeps
    no tensor of the graph its handles are saved in (_Detached)."""

    def __init__(self, first_input, device):
        self.input = _Detached(first_input)
        self.device = device
        self.rng = _C.capture_rng(device)
        self.autocast = _autocast_state()
        self.calls = []      # (run, args, kwargs, where, source, buffers), tensors _Detached
        self.handles = []    # weak references to the handles, in the order autograd saved the tensors
        self.recomputed = None
        self.next_index = None
        self.previous_output = None  # a weak reference to the last block's main output, while the segment runs

    def pack(self, tensor):
        handle = _Handle(self)
        self.handles.append(weakref.ref(handle))
        return handle

    @staticmethod
    def unpack(handle):
        recording = handle.recording
        if recording.recomputed is None:
            recording.recompute()
        if handle not in recording.recomputed:
            raise RuntimeError("memfit: a tensor saved in a checkpointed segment was read twice in one backward")
        return recording.recomputed[handle]

    def recompute(self):
        self.recomputed = weakref.WeakKeyDictionary()
        count = 0

        def keep(tensor):
            nonlocal count
            count += 1
            handle = self.handles[count - 1]() if count <= len(self.handles) else None
            if handle is not None:
                # Detached: the recompute's own graph is not kept.
                self.recomputed[handle] = tensor.detach()

        buffers = [b for call in self.calls for b in call[5]]
        with torch.no_grad():
            saved_buffers = [b.detach().clone() for b in buffers]
        previous_rng = _C.capture_rng(self.device)
        _C.restore_rng(self.rng)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(phase("recompute"))
                stack.enter_context(torch.enable_grad())
                _autocast_contexts(stack, self.autocast)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, _never_unpacked))
                self._replay()
        finally:
            _C.restore_rng(previous_rng)
            with torch.no_grad():
                for b, saved in zip(buffers, saved_buffers):
                    b.copy_(saved)
        if count != len(self.handles):
            raise RuntimeError(f"memfit: a checkpointed segment saved {count} tensors when recomputed but "
                               f"{len(self.handles)} in forward: its blocks must run the same operations each time "
                               "(no data-dependent branches; not compiled after memfit.apply)")

    def _replay(self):
        x = None
        for run, args, kwargs, where, source, _ in self.calls:
            if source == "input":
                x = self.input.attached()
            elif isinstance(source, _Detached):  # else "chained": the previous block's recomputed output
                x = source.attached()
            args = _attach_tensors(args)
            kwargs = {k: _attach_tensors(v) for k, v in kwargs.items()}
            args, kwargs = _calls.with_input(args, kwargs, where, x)
            x = _calls.main_output(run(args, kwargs))


def _never_unpacked(packed):
    raise RuntimeError("memfit: the recompute's own graph is never differentiated")


class Checkpointing:
    """The intercept handler (_calls.Intercept) that runs the planned segments checkpointed, or,
    while ``recompute_all`` is set (a micro-batch redone after an out-of-memory error, or every
    step after a real one), every block in a segment of its own, but those `never` recomputes
    (their forward changes state that outlives it)."""

    def __init__(self, blocks, segments, never=()):
        self.blocks = blocks
        self.use(segments)
        self.each_block = {i: (i, i) for i in range(len(blocks)) if i not in set(never)}
        self.recompute_all = False
        self.current = None

    def use(self, segments):
        """Recomputes these (first, last) segments of blocks from now on (each batch's own plan)."""
        self.segment_of = {}
        for first, last in segments:
            for i in range(first, last + 1):
                self.segment_of[i] = (first, last)

    def recomputes_all(self):
        """Whether the planned segments recompute every block that may be already."""
        return len(self.segment_of) == len(self.each_block)

    def __call__(self, index, args, kwargs, run):
        segment = (self.each_block if self.recompute_all else self.segment_of).get(index)
        where = _calls.main_input(args, kwargs) if segment else None
        if segment is None or where is None or not torch.is_grad_enabled():
            return run(args, kwargs)
        first, last = segment
        x = _calls.get_input(args, kwargs, where)
        if index == first:
            self.current = _Recording(x, str(x.device))
            source = "input"
        elif self.current is None or self.current.next_index != index:
            return run(args, kwargs)  # not called in the order recorded: run plainly
        else:
            previous = self.current.previous_output
            source = "chained" if previous is not None and previous() is x else _Detached(x)
        recording = self.current
        call_args, call_kwargs = _calls.with_input(args, kwargs, where, None)
        call_args, call_kwargs = _detach_tensors(call_args), {k: _detach_tensors(v) for k, v in call_kwargs.items()}
        buffers = list(self.blocks[index].buffers())
        recording.calls.append((run, call_args, call_kwargs, where, source, buffers))
        recording.previous_output = None
        with contextlib.ExitStack() as stack:
            # Weight casts are made per use here, not cached: the segment keeps nothing in forward.
            _autocast_contexts(stack, _autocast_state(), cache_enabled=False, only_enabled=True)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recording.pack, _Recording.unpack))
            out = run(args, kwargs)
        recording.next_index = index + 1
        if index < last:
            output = _calls.main_output(out)
            recording.previous_output = weakref.ref(output) if output is not None else None
        else:
            self.current = None
        return out

    def drop_unfinished(self):
        """Forgets a segment whose forward did not reach its last block (a step that failed)."""
        self.current = None
