"""memfit: make PyTorch training fit a memory budget, over memfit's C++ core.

    import memfit
    with memfit.track(model=model, optimizer=opt) as t:   # exact allocator bytes, by category
        ...
    with memfit.budget("2GiB"):                           # a hard budget (CPU), or CUDA's fraction
        ...
    step = memfit.fit(model, opt, loss_fn, batch, "2GiB") # plan + apply + one verified step
    for batch in loader:
        loss = step(batch)

Importing memfit installs its allocator as LibTorch's CPU allocator, so that the budget and the
tracker see every CPU tensor made from then on (import memfit before building the model).
The measuring, planning and 8-bit optimizer state run in C++ (memfit._C, built against the torch
that is installed); the Python layer routes the user's own module, optimizer and loss to it.
"""
from memfit._loader import load as _load, built_torch_version

_C = _load()
_C.install_budget_allocator()

from memfit._apply import Step, apply, remove  # noqa: E402
from memfit._budget import allocated_bytes, budget  # noqa: E402
from memfit._fit import fit  # noqa: E402
from memfit._optim8bit import Adam8bit  # noqa: E402
from memfit._plan import BudgetError, Plan, plan  # noqa: E402
from memfit._progress import Observer  # noqa: E402
from memfit._sizes import format_bytes, parse_budget as parse_size  # noqa: E402
from memfit._track import track  # noqa: E402

__version__ = "0.1.0"
PLAN_MARGIN = _C.plan_margin  # of a budget, kept free by every plan unless plan(margin=) says otherwise
__all__ = ["track", "budget", "plan", "apply", "remove", "fit", "Plan", "Step", "BudgetError", "Adam8bit",
           "Observer", "allocated_bytes", "format_bytes", "parse_size", "built_torch_version", "PLAN_MARGIN"]
