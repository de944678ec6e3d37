"""Bad input: one clear exception naming the argument, and the model left exactly as it was."""
import pytest
import torch

import memfit
from models import make


def snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [m.training for m in model.modules()], torch.get_rng_state())


def assert_unchanged(model, before):
    state, grads, training, rng = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for p, g in zip(model.parameters(), grads):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    assert [m.training for m in model.modules()] == training
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def case(name="gpt"):
    model, batch, loss_fn = make(name)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # gradients the user had: kept
    return model, torch.optim.AdamW(model.parameters()), batch, loss_fn


def test_a_loss_fn_returning_a_non_scalar():
    model, opt, batch, _ = case()
    before = snapshot(model)
    with pytest.raises(ValueError, match="loss_fn returned a tensor of shape"):
        memfit.plan(model, opt, lambda m, b: m(**b)["logits"].mean(dim=-1), batch, "1GiB", progress=False)
    assert_unchanged(model, before)


def test_a_batch_with_different_sample_counts():
    model, opt, batch, loss_fn = case()
    batch["attention_mask"] = batch["attention_mask"][:4]
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"batch: tensors hold different sample counts.*attention_mask.* has 4"):
        memfit.plan(model, opt, loss_fn, batch, "1GiB", progress=False)
    assert_unchanged(model, before)


@pytest.mark.parametrize("blocks", [torch.nn.Conv3d, lambda m: False, [torch.nn.Linear(2, 2)]])
def test_blocks_matching_nothing(blocks):
    model, opt, batch, loss_fn = case()
    before = snapshot(model)
    with pytest.raises(ValueError, match="^blocks"):
        memfit.plan(model, opt, loss_fn, batch, "1GiB", blocks=blocks, progress=False)
    assert_unchanged(model, before)


def test_a_budget_below_the_floor_names_the_smallest_that_works():
    model, opt, batch, loss_fn = case("mlp")
    before = snapshot(model)
    with pytest.raises(memfit.BudgetError, match=r"smallest budget that works is .* \((\d+) bytes\)") as e:
        memfit.plan(model, opt, loss_fn, batch, 4096, progress=False)
    assert e.value.floor_bytes > 4096
    assert isinstance(e.value, ValueError)
    assert_unchanged(model, before)


def test_a_bad_budget_text_names_the_budget():
    model, opt, batch, loss_fn = case("mlp")
    with pytest.raises(ValueError, match="^budget '2 gigs'"):
        memfit.plan(model, opt, loss_fn, batch, "2 gigs", progress=False)


def test_an_interrupt_while_measuring_leaves_the_model_as_it_was():
    model, opt, batch, loss_fn = case()
    before = snapshot(model)
    calls = []

    def interrupted(m, b):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return loss_fn(m, b)

    with pytest.raises(KeyboardInterrupt):
        memfit.plan(model, opt, interrupted, batch, "1GiB", progress=False)
    assert_unchanged(model, before)
