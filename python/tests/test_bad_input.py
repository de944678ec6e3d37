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


@pytest.mark.parametrize("budget, expected", [(2 ** 70, "^budget 1180591620717411303424: expected at most"),
                                               (0, "^budget 0: expected a positive number of bytes"),
                                               (True, "^budget True: expected bytes as an int")])
def test_a_budget_out_of_range_is_one_line_naming_it(budget, expected):
    model, opt, batch, loss_fn = case("mlp")
    with pytest.raises(ValueError, match=expected) as e:
        memfit.plan(model, opt, loss_fn, batch, budget, progress=False)
    assert "\n" not in str(e.value)


def test_an_optimizer_over_other_parameters_is_refused():
    model, _, batch, loss_fn = case("mlp")
    other = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    before = snapshot(model)
    with pytest.raises(ValueError, match="^optimizer AdamW: holds none of the model's trainable parameters"):
        memfit.plan(model, other, loss_fn, batch, "1GiB", progress=False)
    assert_unchanged(model, before)


def test_apply_without_a_plan_names_it():
    model, opt, _, _ = case("mlp")
    with pytest.raises(ValueError, match="^plan NoneType: expected the memfit.Plan"):
        memfit.apply(model, opt, None)


def test_an_empty_batch_names_it():
    model, opt, batch, loss_fn = case("mlp")
    empty = tuple(t[:0] for t in batch) if isinstance(batch, tuple) else {k: v[:0] for k, v in batch.items()}
    with pytest.raises(ValueError, match="^batch: 0 samples along dimension 0"):
        memfit.plan(model, opt, loss_fn, empty, "1GiB", progress=False)


@pytest.mark.parametrize("argument, value, expected", [
    ("precisions", ("fp64",), r"^precisions 'fp64': expected fp32, bf16 or fp16"),
    ("margin", 0.9, r"^margin 0.9: expected a fraction of the budget from 0 to 0.5"),
    ("offload", "activations", r"^offload 'activations': expected none, optimizer or auto"),
])
def test_a_bad_option_is_named_in_python_terms(argument, value, expected):
    model, opt, batch, loss_fn = case("mlp")
    with pytest.raises(ValueError, match=expected):
        memfit.plan(model, opt, loss_fn, batch, "1GiB", progress=False, **{argument: value})
