"""The user's step as a model memfit's C++ profiler runs part by part (plan/partwise.h).

Part 0 is the model's code before the first block (embeddings, masks), parts 1..N are the
blocks, part N+1 is the code after the last block and the loss. The profiler calls
``forward(run, observer)``; the blocks' calls are seen through _calls.Intercept, which tells the
observer where each part starts (and, where the profiler watches them, when backward first reads
a tensor a block saved). Everything measured, and what it means, is the C++ core's.
"""
import contextlib
import weakref

import torch

from memfit import _batch, _calls, _storage
from memfit._checkpoint import Checkpointing
from memfit._loader import load

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


def _saved_tensors_watched(observer, part, saved, reads):
    """Saved-tensor hooks for a block's forward: the storage of each tensor it saves goes into
    `saved`, and where `reads`, the observer hears when backward reads one (the tensors
    themselves pass through unchanged)."""
    def pack(tensor):
        saved.add(_storage.storage_key(tensor))
        return tensor

    def read(packed):
        if reads:
            observer.saved_tensor_read(part)
        return packed
    return torch.autograd.graph.saved_tensors_hooks(pack, read)


class _Joined(torch.autograd.Function):
    """`out` (made without grad) joined to the graph of `anchors` as a checkpointed segment's
    output is joined to its input's graph, so the graph the model's own code builds after it
    stays alive to the loss; and `kept` held by that graph, as a segment's recording holds the
    tensors it replays the block with. Measuring runs no backward through it."""

    @staticmethod
    def forward(ctx, out, kept, *anchors):
        ctx.kept = kept
        return out.detach()  # the same storage, not a view: the model's code may write into it

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover (never run)
        raise RuntimeError("memfit: a measuring run's graph was differentiated")


def _joined(value, kept, anchors):
    """A block's output as a checkpointed segment hands it on: its floating-point tensors joined
    to the graph of `anchors` (the block's inputs and parameters requiring grad), the first of
    them holding `kept`."""
    if isinstance(value, torch.Tensor):
        return _Joined.apply(value, kept, *anchors) if value.is_floating_point() and anchors else value
    if type(value) in (tuple, list):
        out = []
        for v in value:
            out.append(_joined(v, kept, anchors))
            kept = () if out[-1] is not v else kept
        return type(value)(out)
    return value


_SCALARS = (int, float, bool, str, type(None))


def _fingerprint(value, depth=3):
    """What a value holds, to the depth given, comparable before and after a call: a tensor by its
    identity and version, containers by their items, other objects by their attributes."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version if not value.is_inference() else -1, tuple(value.shape))
    if isinstance(value, _SCALARS):
        return value
    if depth == 0:
        return (type(value).__name__, id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, len(value), tuple(_fingerprint(v, depth - 1) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _fingerprint(v, depth - 1)) for k, v in value.items() if isinstance(k, _SCALARS)))
    fields = getattr(value, "__dict__", None)
    if fields is None or isinstance(value, torch.nn.Module) or callable(value):
        return (type(value).__name__, id(value))
    return (type(value).__name__, tuple((k, _fingerprint(v, depth - 1)) for k, v in fields.items() if not callable(v)))


def _module_state(module):
    """A module's plain attributes (counters, flags), not its parameters, buffers or submodules."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, _SCALARS + (list, dict))}


class _StateWatch:
    """What a block's call could change that outlives it: the objects it is handed (a key/value
    cache), and its modules' plain attributes; `changed()` names the first that did."""

    def __init__(self, block, args, kwargs):
        self.handed = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"`{k}`", v) for k, v in kwargs.items()]
        self.handed = [(name, v) for name, v in self.handed if not isinstance(v, (torch.Tensor, torch.nn.Module) + _SCALARS)]
        self.modules = [(n, m) for b in block.modules for n, m in b.named_modules()]
        self.before = self._now()

    def _now(self):
        return ([_fingerprint(v) for _, v in self.handed], [_fingerprint(_module_state(m)) for _, m in self.modules])

    def changed(self):
        handed, modules = self._now()
        for (name, value), a, b in zip(self.handed, self.before[0], handed):
            if a != b:
                return f"its {name}, a {type(value).__name__}, changed"
        for (name, _), a, b in zip(self.modules, self.before[1], modules):
            if a != b:
                return f"an attribute of its module {name or '(the block)'} changed"
        return None


class ModuleParts(_C.PartwiseModel):
    """loss_fn(model, batch) with the model's blocks as its parts."""

    def __init__(self, model, loss_fn, batch, blocks, device):
        _C.PartwiseModel.__init__(self)
        self.model, self.loss_fn, self.batch, self.blocks, self._device = model, loss_fn, batch, blocks, device
        self._samples = _batch.sample_count(batch)
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        self._previous_output = None  # a weak reference to the last block's main output, in a run as inside a segment
        # Storages alive before any step (the batch, parameters, buffers): a block handed one of
        # them holds nothing a step would not.
        self._standing = {_storage.storage_key(t) for t in [*_batch.tensors(batch), *model.parameters(), *model.buffers()]}

    def parts(self):
        return len(self.blocks) + 2

    def part_name(self, part):
        if part == 0:
            return "(code before the first block)"
        return self.blocks[part - 1].name if part <= len(self.blocks) else "(code after the last block)"

    def recomputable(self, part):
        return 0 < part <= len(self.blocks)

    def non_reentrant_checkpoint(self):
        return True  # as _checkpoint.py recomputes

    def samples(self):
        return self._samples

    def device(self):
        return str(self._device)

    def parameters(self):
        return self._parameters

    def weight_bytes(self):
        return _storage.unique_bytes(self.model.parameters())

    def batch_tensors(self):
        return _batch.tensors(self.batch)

    def forward(self, run, observer):
        part = _batch.narrow(self.batch, 0, run.samples)
        self._previous_output = None
        if observer is not None:
            handler = self._observing(observer, run.blocks_without_grad)
        elif run.recompute_all:
            handler = Checkpointing(self.blocks, [(i, i) for i in range(len(self.blocks))])
        else:
            handler = None
        intercept = _calls.Intercept(self.blocks, handler) if handler is not None else None
        try:
            with autocast(self._device, run.precision):
                return scalar_loss(self.loss_fn(self.model, part))
        finally:
            if intercept is not None:
                intercept.remove()

    def _as_in_segment(self, index, args, kwargs, run, observer):
        """Block `index` run as inside a checkpointed segment (not its first block): without grad,
        its output joined to the graph, and what _checkpoint's recording keeps of its call held
        (its arguments, and its input where that is not the previous block's output). A tensor
        handed to it besides its input that the forward made is told to the observer instead: a
        segment's recording holds it whoever made it (PartObserver::handed)."""
        with torch.no_grad():
            out = run(args, kwargs)
        handed = _batch.tensors((args, kwargs))
        where = _calls.main_input(args, kwargs)
        x = _calls.get_input(args, kwargs, where) if where else None
        previous = self._previous_output() if self._previous_output is not None else None
        made = [t for t in handed if t is not x and _storage.storage_key(t) not in self._standing]
        for t in made:
            observer.handed(index + 1, t)
        kept = tuple(t for t in handed if not (t is x and x is previous) and all(t is not m for m in made))
        anchors = [t for t in handed if t.requires_grad] + [p for p in self.blocks[index].parameters() if p.requires_grad]
        out = _joined(out, kept, anchors)
        output = _calls.main_output(out)
        self._previous_output = weakref.ref(output) if output is not None else None  # holds nothing past the run
        return out

    def _observing(self, observer, blocks_without_grad=False):
        last = len(self.blocks) - 1
        watch = observer.watches_saved_reads()

        def handler(index, args, kwargs, run):
            where = _calls.main_input(args, kwargs)
            observer.enter(index + 1, _calls.get_input(args, kwargs, where) if where else None)
            state = _StateWatch(self.blocks[index], args, kwargs)
            saved = set()
            if blocks_without_grad:  # as inside a checkpointed segment (PartRun::blocks_without_grad)
                out = self._as_in_segment(index, args, kwargs, run, observer)
            else:
                with _saved_tensors_watched(observer, index + 1, saved, watch):
                    out = run(args, kwargs)
            observer.block_returned(index + 1)
            output = _calls.main_output(out)
            if isinstance(output, torch.Tensor):
                observer.block_output(index + 1, output, _storage.storage_key(output) in saved)
            changed = state.changed()
            if changed:
                observer.state_changed(index + 1, changed)
            if index == last:
                observer.enter(index + 2, _calls.main_output(out))
            return out
        return handler
