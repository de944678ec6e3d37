"""Each block's call routed through a handler while installed: how memfit sees the user's
blocks run (profiling) and wraps them (checkpointing), without touching the model's code.

A block's first module gets an instance ``forward`` that calls ``handler(index, args, kwargs,
run)``; ``run(args, kwargs)`` runs the block (its modules one after another). A block's later
sibling modules (inside an nn.Sequential) pass their input through when their parent calls
them: the block ran them already. ``remove()`` puts every ``forward`` back as it was.
"""
import torch

_MISSING = object()


def main_input(args, kwargs):
    """Where the block's main input is: ("arg", i) for the first tensor argument, else
    ("kw", name) for the first tensor keyword argument; None without a tensor."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return ("arg", i)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return ("kw", k)
    return None


def get_input(args, kwargs, where):
    return args[where[1]] if where[0] == "arg" else kwargs[where[1]]


def with_input(args, kwargs, where, tensor):
    """(args, kwargs) with the main input replaced."""
    if where[0] == "arg":
        args = tuple(tensor if i == where[1] else a for i, a in enumerate(args))
    else:
        kwargs = dict(kwargs)
        kwargs[where[1]] = tensor
    return args, kwargs


def main_output(out):
    """The block's main output: the tensor, or the first tensor of a tuple, list or dict (a
    Hugging Face ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for v in out:
            t = main_output(v)
            if t is not None:
                return t
    if isinstance(out, dict):
        for v in out.values():
            t = main_output(v)
            if t is not None:
                return t
    return None


class Intercept:
    """The blocks' calls routed through ``handler`` until ``remove()``."""

    def __init__(self, blocks, handler):
        self.blocks = blocks
        self.handler = handler
        self._saved = []
        self._inside = False
        try:
            for index, block in enumerate(blocks):
                self._route(index, block)
        except BaseException:
            self.remove()
            raise

    def _replace(self, module, forward):
        self._saved.append((module, module.__dict__.get("forward", _MISSING)))
        module.forward = forward

    def _route(self, index, block):
        first_forward = block.first.forward
        siblings = [(m, m.forward) for m in block.modules[1:]]

        def run(args, kwargs):
            out = first_forward(*args, **kwargs)
            if siblings:
                self._inside = True
                try:
                    for module, _ in siblings:
                        out = module(out)
                finally:
                    self._inside = False
            return out

        def routed(*args, **kwargs):
            return self.handler(index, args, kwargs, run)

        self._replace(block.first, routed)
        for module, forward in siblings:
            self._replace(module, self._passthrough(forward))

    def _passthrough(self, forward):
        def sibling(*args, **kwargs):
            if self._inside:
                return forward(*args, **kwargs)
            return args[0] if args else next(iter(kwargs.values()))
        return sibling

    def remove(self):
        for module, previous in reversed(self._saved):
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._saved = []


def intercepted(model):
    """Whether memfit's wrappers are installed on some module of the model."""
    return any(getattr(m.__dict__.get("forward"), "_memfit", False) for m in model.modules())
