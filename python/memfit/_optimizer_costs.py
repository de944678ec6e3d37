"""The user's optimizer as the C++ planner sees it: its family and what it keeps and makes,
measured on copies of its parameters by the C++ rule (plan/optimizer_costs.h)."""
import torch

from memfit._loader import load

_C = load()


def _torch_class_name(optimizer):
    """The class's name where it is torch.optim's own (a subclass or a namesake may differ), else None."""
    name = type(optimizer).__name__
    return name if getattr(torch.optim, name, None) is type(optimizer) else None


def optimizer_family(optimizer):
    """The C++ family of a torch.optim optimizer; another plans as AdamW, by its measured costs."""
    name = _torch_class_name(optimizer)
    return (_C.optimizer_family(name) if name else None) or "adamw"


def has_8bit_state(optimizer):
    """Whether memfit's 8-bit state can stand in for this optimizer's (the C++ rule)."""
    name = _torch_class_name(optimizer)
    family = _C.optimizer_family(name) if name else None
    if family is None:
        return False
    groups = optimizer.param_groups
    return _C.has_8bit_state(family, any(g.get("amsgrad", False) for g in groups),
                             any(g.get("maximize", False) for g in groups))


def _copy_optimizer(optimizer, groups):
    cls = type(optimizer)
    try:
        return cls(groups, **optimizer.defaults)
    except TypeError:
        return cls(groups)


def measure_optimizer(optimizer, tracker, with_8bit):
    """The optimizer's costs on copies of its parameters (zero gradients): state bytes (alive
    between steps), the step's temporaries above them, and a steady step's seconds; with_8bit:
    memfit's 8-bit state's too (its maps, made by plan() beforehand, are resident bytes)."""
    groups, clones = [], []
    with torch.no_grad():
        for g in optimizer.param_groups:
            params = [p.detach().clone().requires_grad_(p.requires_grad) for p in g["params"]]
            for p in params:
                p.grad = torch.zeros_like(p)
            clones += params
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    copy = _copy_optimizer(optimizer, groups)
    costs = [_C.measure_optimizer_steps(copy.step, "fp32", tracker)]  # the C++ rule, this optimizer's steps
    if with_8bit:
        g = optimizer.param_groups[0]
        del copy
        costs.append(_C.measure_8bit_cost(tracker, clones, g["lr"], g["betas"][0], g["betas"][1], g["weight_decay"],
                                          type(optimizer) is torch.optim.AdamW))
    return costs
