"""memfit.fit: one verified step under the budget, and an out-of-memory error in a later step
recovered by the C++ policy with no sample lost; import memfit's check of the torch version."""
import copy

import pytest
import torch

import memfit
from memfit import _loader
from models import make
from test_plan_apply import plain_peak


def test_fit_verifies_one_step_under_the_budget():
    model, batch, loss_fn = make("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    budget = int(plain_peak("cnn") * 0.6)
    step = memfit.fit(model, opt, loss_fn, batch, budget, progress=False)
    try:
        v = step.verified
        assert v["peak_bytes"] <= budget == v["budget_bytes"] and v["optimizer_state_made"]
        with memfit.budget(budget) as b:  # the state exists now: the plan's steady peak
            step(batch)
        assert abs(v["predicted_peak_bytes"] - b.peak_bytes) <= 0.05 * b.peak_bytes
    finally:
        memfit.remove(model)


def test_apply_recovers_from_an_out_of_memory_error_under_the_plans_budget_and_loses_no_sample():
    model, batch, loss_fn = make("mlp")
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    armed = []

    def failing_once(m, b):
        if armed and armed.pop():
            memfit._C.fail_allocation_after(2)  # the forward's second allocation fails, once
        return loss_fn(m, b)

    plan = memfit.plan(model, opt, failing_once, batch, "1GiB", precisions=("fp32",), micro_batch=2048, progress=False)
    armed.append(True)
    step = memfit.apply(model, opt, plan)  # no budget given: the plan's, recovering as the C++ trainer does
    assert step.budget == plan.budget_bytes
    try:
        loss = step(batch)
    finally:
        memfit._C.fail_allocation_after(0)
        memfit.remove(model)
    # The C++ policy (runtime/oom_recovery.h): the micro-batch redone with every block recomputed;
    # an injected error is not a real one, so later steps keep the planned micro-batch.
    assert step.oom_splits == 1 and step.micro_batch == 2048
    twin_opt.zero_grad()
    expected = loss_fn(twin, batch)
    expected.backward()
    twin_opt.step()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_module_built_for_another_torch_says_what_to_do(monkeypatch):
    monkeypatch.setattr(_loader, "built_torch_version", lambda: "0.0.1")
    with pytest.raises(ImportError, match=r"built for torch 0\.0\.1 but this is torch .*pip install"):
        _loader.load()
