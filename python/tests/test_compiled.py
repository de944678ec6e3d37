"""torch.compile and memfit: memfit plans, recomputes and steps the eager model, so a model that
torch.compile reached is refused by name before any step (memfit._compiled says why)."""
import pytest
import torch

if not hasattr(torch, "compile"):
    pytest.skip("torch.compile exists from torch 2.0", allow_module_level=True)

import memfit  # noqa: E402
from models import make  # noqa: E402


def test_a_compiled_model_or_block_is_refused_by_name_before_planning():
    model, batch, loss_fn = make("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"model: compiled by torch.compile\(model\); expected the eager model"):
        memfit.plan(torch.compile(model), opt, loss_fn, batch, "1GiB", progress=False)
    model.h[2].forward = torch.compile(model.h[2].forward)
    with pytest.raises(ValueError, match=r"compiled by h.2.forward = torch.compile\(...\)"):
        memfit.fit(model, opt, loss_fn, batch, "1GiB", progress=False)


def test_a_model_compiled_after_planning_is_refused_when_applied():
    model, batch, loss_fn = make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = memfit.plan(model, opt, loss_fn, batch, "1GiB", precisions=("fp32",), progress=False)
    model.compile()
    with pytest.raises(ValueError, match=r"model: compiled by model.compile\(\)"):
        memfit.apply(model, opt, plan)
