"""memfit.track: exact allocator bytes of the code inside it, and what they were at the peak."""
import json

import torch

from memfit import _blocks, _storage
from memfit._loader import load
from memfit._phases import set_phase, set_tag

_C = load()


class _ModuleTags:
    """Forward hooks tagging allocations with the running module (its index in `names`); in
    backward, a hook on each module's output tags what follows with that module."""

    def __init__(self, model):
        self.names = [name or type(model).__name__ for name, _ in model.named_modules()]
        self.handles = []
        self.stack = []
        for index, (_, module) in enumerate(model.named_modules()):
            self.handles.append(module.register_forward_pre_hook(self._enter(index, module is model)))
            self.handles.append(module.register_forward_hook(self._leave(index)))

    def _enter(self, index, root):
        def hook(module, args):
            if root:
                self.stack.clear()
                if set_phase("forward") in ("backward", "recompute"):
                    set_phase("recompute")
            self.stack.append(set_tag(index))
        return hook

    def _leave(self, index):
        def on_grad(grad):
            set_tag(index)

        def hook(module, args, output):
            if self.stack:
                set_tag(self.stack.pop())
            first = output
            while isinstance(first, (tuple, list)) and first:
                first = first[0]
            if isinstance(first, torch.Tensor) and first.requires_grad and torch.is_grad_enabled():
                first.register_hook(on_grad)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


class _Patched:
    """An attribute replaced for a while (an instance's method, torch.autograd.backward), then put back."""

    _MISSING = object()

    def __init__(self, owner, name, replacement, instance=True):
        self.owner, self.name = owner, name
        self.previous = owner.__dict__.get(name, self._MISSING) if instance else getattr(owner, name)
        setattr(owner, name, replacement)

    def restore(self):
        if self.previous is self._MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.previous)


class track:
    """Exact allocator bytes of the code inside the ``with`` block, and what they were at the peak.

    Every allocation and free LibTorch's allocators make on this thread (and in autograd's
    backward) is counted, to the byte, by memfit's C++ tracker. Tensors of ``model`` and
    ``optimizer`` that exist before the block count from its start.

        with memfit.track(model=model, optimizer=opt) as t:
            loss = loss_fn(model, batch); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        t.peak_bytes, t.categories, t.phase, t.module

    After the block:

    - ``peak_bytes``: the highest live bytes;
    - ``categories``: at the peak, ``weights`` (the model's parameters and buffers),
      ``gradients`` (their ``.grad``), ``optimizer_state`` (the optimizer's state tensors),
      ``activations`` (other tensors made while the model ran forward) and ``other``
      (the rest: the batch, the loss, gradients of activations in backward), summing exactly to
      ``peak_bytes``; decided from the tensors themselves, at the optimizer's steps and the end;
    - ``phase`` (``forward``, ``backward``, ``optimizer``, ...) and ``module`` (the qualified
      name of the module running, e.g. ``transformer.h.3.mlp``) at the peak;
    - ``to_json()``, ``save_html(path)`` (the offline HTML report ``memfit report`` draws).

    ``device``: the device counted (the model's by default).
    """

    def __init__(self, model=None, optimizer=None, device=None, title=None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"model {type(model).__name__}: expected a torch.nn.Module or None")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer {type(optimizer).__name__}: expected a torch.optim.Optimizer or None")
        self.model, self.optimizer = model, optimizer
        if device is None and model is not None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = torch.device(device or "cpu")
        self.title = title or "memfit.track" + (f": {type(model).__name__}" if model is not None else "")
        self.peak_bytes = None
        self.categories = None
        self.details = None
        self.phase = None
        self.module = None
        self._analysis = None

    # --- what is known about the tensors ---
    def _roles(self):
        params = list(self.model.parameters()) if self.model is not None else []
        buffers = list(self.model.buffers()) if self.model is not None else []
        grads = [p.grad for p in params if p.grad is not None]
        state = _storage.optimizer_state_tensors(self.optimizer) if self.optimizer is not None else []
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if all(p is not q for q in params):
                        params.append(p)
                        if p.grad is not None:
                            grads.append(p.grad)
        return params, buffers, grads, state

    def _snapshot(self):
        self._tracker.snapshot(*self._roles())

    def _wrap_optimizer(self):
        opt, patches = self.optimizer, []
        step, zero_grad = opt.step, opt.zero_grad

        def tracked_step(*args, **kwargs):
            self._snapshot()
            previous = set_phase("optimizer")
            try:
                return step(*args, **kwargs)
            finally:
                set_phase("other" if previous == "optimizer" else previous)
                self._snapshot()

        def tracked_zero_grad(*args, **kwargs):
            self._snapshot()
            return zero_grad(*args, **kwargs)

        patches.append(_Patched(opt, "step", tracked_step))
        patches.append(_Patched(opt, "zero_grad", tracked_zero_grad))
        return patches

    def _wrap_backward(self):
        backward = torch.autograd.backward

        def tracked_backward(*args, **kwargs):
            previous = set_phase("backward")
            try:
                return backward(*args, **kwargs)
            finally:
                set_phase("other" if previous in ("forward", "backward") else previous)

        return _Patched(torch.autograd, "backward", tracked_backward, instance=False)

    def __enter__(self):
        self._tracker = _C.Tracker(str(self.device))
        self._tracker.adopt(sum(self._roles(), []))
        self._tracker.start_recording()
        self._install = _C.TrackerInstall(self._tracker)
        self._tags = _ModuleTags(self.model) if self.model is not None else None
        self._patches = [self._wrap_backward()] + (self._wrap_optimizer() if self.optimizer is not None else [])
        self._snapshot()
        return self

    def __exit__(self, *exc):
        try:
            self._snapshot()
        finally:
            for p in reversed(self._patches):
                p.restore()
            if self._tags is not None:
                self._tags.remove()
            self._install.close()
            self._tracker.stop_recording()
        groups, tag_group = self._groups()
        self._analysis = self._tracker.analyze(tag_group, [g for g in groups])
        a = self._analysis
        self.peak_bytes = a.peak_bytes
        self.categories = a.categories()
        self.details = a.details()
        self.phase = a.peak_phase
        names = self._tags.names if self._tags is not None else []
        self.module = names[a.peak_tag] if 0 <= a.peak_tag < len(names) else None
        self._tracker = None
        return False

    def _groups(self):
        """The groups the report draws activations by (the model's blocks), and each module's group."""
        if self.model is None:
            return [], []
        try:
            blocks = _blocks.find_blocks(self.model)
        except ValueError:
            blocks = [_blocks.Block(n, [m]) for n, m in self.model.named_children()]
        owner = {}
        for g, block in enumerate(blocks):
            for module in block.modules:
                for sub in module.modules():
                    owner[id(sub)] = g
        tag_group = [owner.get(id(m), -1) for _, m in self.model.named_modules()]
        return [b.name for b in blocks], tag_group

    # --- results ---
    def _check_done(self):
        if self._analysis is None:
            raise RuntimeError("memfit.track: the results exist once the with block has ended")

    def to_dict(self):
        """The results as a dict (bytes as integers)."""
        self._check_done()
        return {"peak_bytes": self.peak_bytes, "categories": dict(self.categories), "details": dict(self.details),
                "phase": self.phase, "module": self.module, "device": str(self.device),
                "phases": [{"phase": p, "start_s": s, "end_s": e, "peak_bytes": b}
                           for p, s, e, b in self._analysis.phase_peaks()]}

    def to_json(self):
        """The results as JSON text: peak_bytes, categories, phase, module, per-phase peaks."""
        return json.dumps(self.to_dict())

    def save_html(self, path, budget=None):
        """Writes the offline HTML report of the tracked code (the one ``memfit report --html`` writes)."""
        self._check_done()
        budget_bytes = None
        if budget is not None:
            from memfit._sizes import parse_budget
            budget_bytes = parse_budget(budget, "budget")
        self._analysis.write_html(str(path), self.title, str(self.device), budget_bytes)

    def __repr__(self):
        if self._analysis is None:
            return "memfit.track(running)"
        from memfit._sizes import format_bytes
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.categories.items())
        return f"memfit.track(peak {format_bytes(self.peak_bytes)} in {self.phase} at {self.module}: {parts})"
