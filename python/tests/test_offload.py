"""The optimizer offloaded from Python (offload="optimizer" / "auto"): the same weights as a plain
step, the device's bytes below what a device-only plan needs, the existing state moved off it and,
by memfit.remove, back."""
import pytest
import torch

import memfit
from models import CNN, cnn_batch, cnn_loss, make
from test_plan_apply import plain_peak, plain_step


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_offloaded_steps_give_the_plain_steps_weights_bit_for_bit(name):
    model, batch, loss_fn = make(name)
    reference, _, _ = make(name)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    samples = memfit._batch.sample_count(batch)
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), optimizer_state="fp32",
                       micro_batch=samples, offload="optimizer", progress=False)
    assert plan.optimizer_offloaded and plan.predicted_host_peak_bytes > 0
    step = memfit.apply(model, opt, plan)
    try:
        for _ in range(3):
            torch.manual_seed(1)  # dropout draws the same masks on both sides
            loss = step(batch)
            torch.manual_seed(1)
            ref_loss = plain_step(reference, ref_opt, loss_fn, batch)
            assert loss == pytest.approx(ref_loss, rel=1e-6)
    finally:
        memfit.remove(model)
    for got, expected in zip(weights(model), weights(reference)):
        assert torch.equal(got, expected)
    assert all(p.grad is None for p in model.parameters()), "no device gradient is left after the step"


def test_below_the_device_only_floor_auto_offloads_and_the_step_fits():
    name = "mlp"
    budget = int(plain_peak(name) * 0.3)
    model, batch, loss_fn = make(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(memfit.BudgetError, match="offload='optimizer'"):
        memfit.plan(model, opt, loss_fn, batch, budget, precisions=("fp32",), optimizer_state="fp32", progress=False)
    plan = memfit.plan(model, opt, loss_fn, batch, budget, precisions=("fp32",), optimizer_state="fp32",
                       offload="auto", progress=False)
    assert plan.optimizer_offloaded, str(plan)
    step = memfit.apply(model, opt, plan)
    try:
        with memfit.budget(budget) as b:
            losses = [step(batch) for _ in range(4)]
    finally:
        memfit.remove(model)
    assert b.peak_bytes <= budget
    error = abs(plan.predicted_peak_bytes - b.peak_bytes) / b.peak_bytes
    assert error <= 0.05, f"{plan}\nmeasured {b.peak_bytes}, predicted {plan.predicted_peak_bytes} ({error:.1%})"
    assert step.oom_splits == 0
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("segments", [[], ["layers.1", "layers.2"]])
def test_offloaded_plans_are_predicted_within_1_percent(segments):
    """Wide convolutions on small maps, so that gradients weigh as much as activations: offloaded,
    each block's gradients leave one at a time while its backward runs, and the prediction
    counts them so (measured so in the profile), not as a device-only step keeps them."""
    torch.manual_seed(0)
    model, batch, loss_fn = CNN(channels=128, blocks=4), cnn_batch(batch=16, size=8), cnn_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_step(model, opt, loss_fn, batch)
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), optimizer_state="fp32",
                       micro_batch=8, offload="optimizer", progress=False).recomputing(segments)
    assert plan.optimizer_offloaded
    step = memfit.apply(model, opt, plan)
    try:
        with memfit.budget(1 << 40) as b:
            for _ in range(2):
                step(batch)
    finally:
        memfit.remove(model)
    error = (plan.predicted_peak_bytes - b.peak_bytes) / b.peak_bytes
    assert abs(error) <= 0.01, f"{plan}\nmeasured {b.peak_bytes}, predicted {plan.predicted_peak_bytes} ({error:+.2%})"


def test_an_optimizers_existing_state_leaves_the_device():
    model, batch, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_step(model, opt, loss_fn, batch)  # the state exists: 2 fp32 moments per parameter
    moments = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    samples = memfit._batch.sample_count(batch)
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), optimizer_state="fp32",
                       micro_batch=samples, offload="optimizer", progress=False)
    before = memfit.allocated_bytes()
    step = memfit.apply(model, opt, plan)
    try:
        after = memfit.allocated_bytes()
        assert before - after >= state_bytes, "the fp32 moments left the device's bytes"
        masters = step.offload.masters
        assert [id(p) for p in opt.param_groups[0]["params"]] == [id(m) for m in masters]
        for p, m in zip(model.parameters(), masters):
            assert torch.equal(opt.state[m]["exp_avg"], moments[id(p)]), "the moments carried over exactly"
        assert weight_bytes > 0
        step(batch)
    finally:
        memfit.remove(model)


def test_removing_an_offloaded_plan_gives_the_optimizer_back_and_it_steps_on_as_one_never_offloaded():
    model, batch, loss_fn = make("mlp")
    reference, _, _ = make("mlp")
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    samples = memfit._batch.sample_count(batch)
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), optimizer_state="fp32",
                       micro_batch=samples, offload="optimizer", progress=False)
    step = memfit.apply(model, opt, plan)
    for _ in range(2):
        step(batch)
        plain_step(reference, ref_opt, loss_fn, batch)
    assert memfit.remove(model)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [list(map(id, model.parameters()))]
    for p, q in zip(model.parameters(), reference.parameters()):
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert mine.keys() == theirs.keys()
        for k, v in theirs.items():  # the step counts as torch keeps them, the moments where they were made
            assert (mine[k].dtype, mine[k].shape, mine[k].device) == (v.dtype, v.shape, v.device), k
            assert torch.equal(mine[k], v), k
    for _ in range(2):  # no hook streams the gradients away any more: the plain steps agree bit for bit
        plain_step(model, opt, loss_fn, batch)
        plain_step(reference, ref_opt, loss_fn, batch)
    for got, expected in zip(weights(model), weights(reference)):
        assert torch.equal(got, expected)


def test_a_bad_offload_is_one_value_error_naming_it():
    model, batch, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="^offload 'activations': expected"):
        memfit.plan(model, opt, loss_fn, batch, 1 << 30, offload="activations", progress=False)
