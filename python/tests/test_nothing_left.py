"""Nothing left behind: after a step that failed, or steps of any plan, and memfit.remove(model),
the allocator holds the bytes it held before the plan (and the optimizer's state, as it held it
then), with the model and optimizer alive and with them gone, the step object still referenced
(as a user's variable keeps it). A failed step's error reaches the caller."""
import gc

import pytest
import torch

import memfit
from memfit import _C
from models import make
from test_plan_apply import plain_step

SEGMENT = ("h.1", "h.3")  # three blocks recomputed together: a failure can strike in the middle


def fail_in_forward(model, armed):
    """h.2, the segment's middle block, raises in its first call after arming: in forward."""
    return _fail_on_call(model.h[2], armed, 1, "h.2 failed")


def fail_between_blocks(model, armed):
    """The model's own code raises between h.1 and h.2: the segment is left half recorded."""
    def hook(module, args):
        if armed:
            raise ValueError("between h.1 and h.2")
    return model.h[2].register_forward_pre_hook(hook).remove


def fail_in_recompute(model, armed):
    """h.2 raises in its second call after arming: its recompute, in backward."""
    return _fail_on_call(model.h[2], armed, 2, "h.2 failed in its recompute")


def fail_out_of_memory(model, armed):
    """A budget far too small for the plan: recovery gives up (set by the test as the step's budget)."""
    return lambda: None


def _fail_on_call(block, armed, n, message):
    forward, calls = block.forward, []

    def failing(*args, **kwargs):
        if armed:
            calls.append(1)
            if len(calls) == n:
                raise ValueError(message)
        return forward(*args, **kwargs)

    block.forward = failing
    return lambda: block.__dict__.pop("forward")


FAILURES = {
    # name: (what installs it, what reaches the caller: torch 1.13's autograd engine re-raises an
    # error of a saved-tensor hook, the recompute, as a RuntimeError with its text)
    "a block's error in forward": (fail_in_forward, ValueError, "h.2 failed"),
    "the model's error between two blocks of a segment": (fail_between_blocks, ValueError, "between"),
    "a block's error in its recompute": (fail_in_recompute, (ValueError, RuntimeError), "h.2 failed in its recompute"),
    "an out-of-memory error that recovery gives up on": (fail_out_of_memory, RuntimeError, "out of memory"),
}


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_a_failed_step_and_remove_leave_the_bytes_of_before_the_plan(name):
    install, error, text = FAILURES[name]
    gc.collect()
    before_model = memfit.allocated_bytes()
    model, batch, loss_fn = make("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    armed = []
    uninstall = install(model, armed)
    before = memfit.allocated_bytes()
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), optimizer_state="fp32",
                       micro_batch=8, progress=False).recomputing([SEGMENT])
    tiny = memfit.allocated_bytes() + (1 << 20) if install is fail_out_of_memory else None
    step = memfit.apply(model, opt, plan, budget=tiny)
    armed.append(True)
    with pytest.raises(error, match=text):
        step(batch)
    memfit.remove(model)
    uninstall()
    assert memfit.allocated_bytes() == before, "the model and optimizer alive: only their own bytes"
    assert all(p.grad is None for p in model.parameters()), "no partial sum of the failed step is left"
    del model, opt, plan, batch, loss_fn, uninstall  # `step` is still referenced, as a user's variable keeps it
    gc.collect()
    assert memfit.allocated_bytes() == before_model, "the model gone: none of its bytes or the step's are held"


def test_a_removed_step_says_so_when_called():
    model, batch, loss_fn = make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), progress=False)
    step = memfit.apply(model, opt, plan)
    assert memfit.remove(model) and not memfit.remove(model)
    with pytest.raises(RuntimeError, match=r"^step: its plan was taken off the model by memfit.remove\(model\)"):
        step(batch)


@pytest.mark.parametrize("state,offload", [("fp32", "none"), ("8bit", "none"), ("fp32", "optimizer"),
                                           ("8bit", "optimizer")])
def test_remove_leaves_the_bytes_of_before_the_plan_with_the_optimizers_state(state, offload):
    """The user's AdamW had stepped: its fp32 state is part of the bytes before the plan, and is
    given back as it was kept (8-bit moments in fp32, offloaded ones on the device)."""
    model, batch, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_step(model, opt, loss_fn, batch)
    _C.make_dynamic_maps("cpu")  # the 8-bit maps: constants, made once for the process's life
    gc.collect()
    before = memfit.allocated_bytes()
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), optimizer_state=state,
                       micro_batch=512, offload=offload, progress=False)
    assert (plan.optimizer_state, plan.optimizer_offloaded) == (state, offload == "optimizer")
    step = memfit.apply(model, opt, plan)
    for _ in range(2):
        step(batch)
    masters = [_C.StorageWatch(m) for m in step.offload.masters] if step.offload else []
    memfit.remove(model)
    assert memfit.allocated_bytes() == before
    assert not any(w.alive() for w in masters), "the host masters are released"
