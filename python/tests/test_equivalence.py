"""An applied plan computes the plain step's gradients: bit for bit with checkpointing in fp32
(dropout's masks drawn again, BatchNorm's statistics counted once), to float tolerance with
accumulation; it trains; memfit's 8-bit state is about a quarter of fp32's."""
import copy
import io

import pytest
import torch

import memfit
from models import GPT, gpt_batch, gpt_loss, make
from test_plan_apply import plain_peak


def plain_gradients(model, loss_fn, batch, seed=1):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def applied_gradients(model, step, batch, seed=1):
    torch.manual_seed(seed)
    step.gradients(batch)
    return [p.grad.clone() for p in model.parameters()]


def tight_plan(name, model, batch, loss_fn, micro_batch, fraction=0.45):
    """A plan in fp32 under a fraction of the plain step's peak (checkpointing needed)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    budget = int(plain_peak(name) * fraction)
    plan = memfit.plan(model, opt, loss_fn, batch, budget, precisions=("fp32",), micro_batch=micro_batch,
                       optimizer_state="fp32", progress=False)
    return plan, opt


@pytest.mark.parametrize("name,fraction", [("gpt", 0.45), ("cnn", 0.62)])
def test_checkpointed_gradients_equal_the_plain_steps_bit_for_bit(name, fraction):
    model, batch, loss_fn = make(name)
    reference = copy.deepcopy(model)
    plan, opt = tight_plan(name, model, batch, loss_fn, micro_batch=16, fraction=fraction)
    assert plan.checkpointed, str(plan)
    expected = plain_gradients(reference, loss_fn, batch)
    step = memfit.apply(model, opt, plan)
    try:
        got = applied_gradients(model, step, batch)
    finally:
        memfit.remove(model)
    for (pname, _), g, e in zip(model.named_parameters(), got, expected):
        assert torch.equal(g, e), f"{pname}: max difference {(g - e).abs().max().item()}"
    for (bname, b), e in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, e), f"{bname} differs: the recompute must not count the batch twice"


def test_accumulation_equals_the_plain_step_to_float_tolerance():
    torch.manual_seed(0)
    model, batch = GPT(dropout=0.0), gpt_batch()
    reference = copy.deepcopy(model)
    plan, opt = tight_plan("gpt", model, batch, gpt_loss, micro_batch=4)
    assert plan.accumulation == 4
    expected = plain_gradients(reference, gpt_loss, batch)
    step = memfit.apply(model, opt, plan)
    try:
        got = applied_gradients(model, step, batch)
    finally:
        memfit.remove(model)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_loss_falls_over_20_steps_under_the_budget():
    model, batch, loss_fn = make("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    budget = int(plain_peak("gpt") * 0.45)
    step = memfit.fit(model, opt, loss_fn, batch, budget, progress=False)
    try:
        losses = [step.first_loss] + [step(batch) for _ in range(19)]
    finally:
        memfit.remove(model)
    assert step.verified["peak_bytes"] <= budget
    assert losses[-1] < 0.8 * losses[0], losses


def test_remove_puts_the_blocks_back():
    model, batch, loss_fn = make("gpt")
    plan, opt = tight_plan("gpt", model, batch, loss_fn, micro_batch=16)
    memfit.apply(model, opt, plan)
    assert any("forward" in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="applied"):
        memfit.apply(model, opt, plan)
    assert memfit.remove(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not memfit.remove(model)


def state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def test_8bit_state_is_at_most_0_27_of_fp32_and_round_trips():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    x = torch.randn(32, 512)
    fp32 = torch.optim.AdamW(copy.deepcopy(model).parameters())
    eight = memfit.Adam8bit(model.parameters(), weight_decay=0.01)
    for opt, m in ((fp32, fp32.param_groups[0]["params"]), (eight, list(model.parameters()))):
        for p in m:
            p.grad = torch.randn_like(p)
        opt.step()
    assert state_bytes(eight) <= 0.27 * state_bytes(fp32), (state_bytes(eight), state_bytes(fp32))
    buffer = io.BytesIO()
    torch.save(eight.state_dict(), buffer)
    again = memfit.Adam8bit(model.parameters(), weight_decay=0.01)
    buffer.seek(0)
    again.load_state_dict(torch.load(buffer))
    for p in model.parameters():
        for k, v in eight.state[p].items():
            w = again.state[p][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype if isinstance(v, torch.Tensor) else v == w), k
    with memfit.track(model=model, optimizer=eight) as t:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        eight.step()
    assert t.categories["optimizer_state"] == state_bytes(eight)
