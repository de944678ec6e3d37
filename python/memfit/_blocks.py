"""Which parts of the user's model are blocks: what checkpointing recomputes and the plan names.

A block is one module, or, inside an nn.Sequential, a module with the sibling modules that run
after it up to the next block (an MLP's Linear with its ReLU): the sequence of blocks then runs
one after another, each block's output the next one's input.
"""
import torch

from memfit._compiled import check_not_compiled

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


class Block:
    """One block: its name (a qualified module name) and the modules it runs, in order."""

    def __init__(self, name, modules):
        self.name = name
        self.modules = modules

    @property
    def first(self):
        return self.modules[0]

    @property
    def last(self):
        return self.modules[-1]

    def parameters(self):
        seen = set()
        for module in self.modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def buffers(self):
        for module in self.modules:
            yield from module.buffers()

    def __repr__(self):
        return f"Block({self.name})"


def _parameter_count(module):
    return sum(p.numel() for p in module.parameters())


def _repeated_class(model):
    """The module class repeated inside ModuleLists/Sequentials whose instances hold the most
    parameters together (FSDP's auto-wrap and Hugging Face's checkpointing choose the same)."""
    totals, counts = {}, {}
    for container in model.modules():
        if not isinstance(container, _CONTAINERS):
            continue
        for child in container.children():
            cls = type(child)
            counts[cls] = counts.get(cls, 0) + 1
            totals[cls] = totals.get(cls, 0) + _parameter_count(child)
    repeated = [cls for cls, n in counts.items() if n >= 2 and totals[cls] > 0]
    return max(repeated, key=lambda cls: totals[cls]) if repeated else None


def _describe(blocks):
    if isinstance(blocks, type):
        return blocks.__name__
    if callable(blocks) and not isinstance(blocks, torch.nn.Module):
        return getattr(blocks, "__name__", "the predicate")
    return repr(blocks)


def _selector(model, blocks):
    """A predicate over modules for `blocks` (a class, a predicate, or modules; None: the
    repeated class, which the caller found)."""
    if blocks is None:
        cls = _repeated_class(model)
        return lambda m: type(m) is cls
    if isinstance(blocks, type):
        if not issubclass(blocks, torch.nn.Module):
            raise ValueError(f"blocks {blocks.__name__}: expected a torch.nn.Module class, a predicate, a list of "
                             "modules or None")
        return lambda m: isinstance(m, blocks)
    if isinstance(blocks, torch.nn.Module):
        blocks = [blocks]
    if isinstance(blocks, (list, tuple)):
        wanted = {id(m) for m in blocks}
        if not all(isinstance(m, torch.nn.Module) for m in blocks):
            raise ValueError("blocks: a list must hold modules of the model")
        mine = {id(m) for m in model.modules()}
        if not wanted <= mine:
            raise ValueError("blocks: a module in the list is not part of the model")
        return lambda m: id(m) in wanted
    if callable(blocks):
        return blocks
    raise ValueError(f"blocks {blocks!r}: expected a module class, a predicate over modules, a list of modules or None")


def _outermost(model, select):
    """(name, module) of the selected modules, outermost only, in registration order."""
    found, inside = [], set()
    for name, module in model.named_modules():
        if module is model or id(module) in inside:
            continue
        if select(module):
            found.append((name, module))
            inside.update(id(m) for m in module.modules())
    return found


def _with_sequential_siblings(model, found):
    """Each block inside an nn.Sequential takes the siblings after it up to the next block."""
    parents = {}
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            parents[id(child)] = (name, module, child_name)
    selected = {id(m) for _, m in found}
    out = []
    for name, module in found:
        parent_name, parent, child_name = parents.get(id(module), ("", None, name))
        if not isinstance(parent, torch.nn.Sequential):
            out.append(Block(name, [module]))
            continue
        names = list(parent._modules.keys())
        i = names.index(child_name)
        group = [module]
        j = i + 1
        while j < len(names) and id(parent._modules[names[j]]) not in selected:
            group.append(parent._modules[names[j]])
            j += 1
        label = name if len(group) == 1 else f"{parent_name + '.' if parent_name else ''}{names[i]}-{names[j - 1]}"
        out.append(Block(label, group))
    return out


def _holds_parameters(module):
    return next(module.parameters(), None) is not None


def _top_modules(model):
    """The modules holding parameters one level below the model, or below the wrapper (a module
    whose one child holds them all: Hugging Face's `model.model`) where there is one."""
    top = model
    while True:
        children = [c for c in top.children() if _holds_parameters(c)]
        if len(children) != 1:
            return children
        top = children[0]


def _in_call_order(model, probe):
    """The model's top modules that `probe` (one forward) calls exactly once, as blocks in the
    order called: a model with no repeated block is planned as the modules it runs in order."""
    names = {id(m): n for n, m in model.named_modules()}
    calls = []
    hooks = [m.register_forward_pre_hook(lambda module, args: calls.append(module)) for m in _top_modules(model)]
    try:
        probe()
    finally:
        for h in hooks:
            h.remove()
    once = [m for i, m in enumerate(calls) if calls.count(m) == 1]
    if not once:
        raise ValueError("blocks None: the model has no module class repeated inside a ModuleList or Sequential, "
                         "and no submodule holding parameters runs once per forward; pass blocks= a module class, "
                         "a predicate or a list of modules")
    return [Block(names[id(m)], [m]) for m in once]


def find_blocks(model, blocks=None, probe=None):
    """The model's blocks, in order: ValueError when `blocks` matches no module of the model,
    or when torch.compile reached it (memfit plans the eager model). `blocks` None: the
    repeated module class with the most parameters; where there is none, the modules `probe`
    (a callable running one forward) calls once each, in that order."""
    check_not_compiled(model)
    if blocks is None and _repeated_class(model) is None:
        if probe is None:
            raise ValueError("blocks None: the model has no module class repeated inside a ModuleList or Sequential; "
                             "pass blocks= a module class, a predicate or a list of modules")
        return _in_call_order(model, probe)
    select = _selector(model, blocks)
    try:
        found = _outermost(model, select)
    except Exception as e:  # a predicate that fails on some module
        raise ValueError(f"blocks {_describe(blocks)}: the predicate raised {type(e).__name__}: {e}") from None
    if not found:
        raise ValueError(f"blocks {_describe(blocks)}: matches no module of the model")
    return _with_sequential_siblings(model, found)
