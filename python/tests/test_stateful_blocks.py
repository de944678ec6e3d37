"""Blocks whose forward changes state that outlives the call, as Hugging Face's layers append to
the key/value cache they are handed when use_cache is on: found when the model is profiled, and
never recomputed (a recompute would append again); a Hugging Face-style config's cache is turned
off while memfit trains, as Hugging Face's own checkpointing does. And an error that is not an
out-of-memory error reaches the user as it was."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit._loader import load

_C = load()


class Cache:
    """A key/value cache the model makes each forward and hands to every layer, which appends."""

    def __init__(self):
        self.keys = []

    def append(self, k):
        self.keys.append(k)
        return torch.cat(self.keys, dim=1) if len(self.keys) > 1 else k


class Config:
    """What memfit reads of a Hugging Face config: use_cache, and to_dict."""

    def __init__(self, use_cache):
        self.use_cache = use_cache

    def to_dict(self):
        return {"use_cache": self.use_cache}


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x, cache=None):
        h = self.down(F.gelu(self.up(self.norm(x))))
        if cache is not None:
            h = h + cache.append(h)[:, -h.shape[1]:]  # the cache's last entry: this call's
        return x + h


class CachedLM(nn.Module):
    def __init__(self, d=64, vocab=128, layers=4, use_cache=True):
        super().__init__()
        self.config = Config(use_cache)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, cache_on=None):
        cache = Cache() if (self.config.use_cache if cache_on is None else cache_on) else None
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cache=cache)
        return self.head(x)


def lm_loss(model, batch):
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def with_hand_made_cache(model):
    """A model without a config: its cache is its own code's, which memfit cannot turn off."""
    model.config = None
    forward = model.forward
    model.forward = lambda ids: forward(ids, cache_on=True)
    return model


def test_a_block_appending_to_a_cache_it_is_handed_is_never_recomputed():
    torch.manual_seed(0)
    model = with_hand_made_cache(CachedLM())
    batch = torch.randint(0, 128, (16, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain = memfit.plan(model, opt, lm_loss, batch, 1 << 40, precisions=("fp32",), progress=False)
    assert plain.never_recomputed == [0, 1, 2, 3], plain.notes
    assert any("never recomputed" in n and "Cache" in n for n in plain._profile.notes)
    with pytest.raises(ValueError, match="layers.1"):
        plain.recomputing(["layers.1"])  # (the planner refuses a block that must not be recomputed)


def test_a_recovery_at_a_longer_length_than_profiled_does_not_recompute_a_stateful_block():
    torch.manual_seed(0)
    model = with_hand_made_cache(CachedLM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, opt, lm_loss, torch.randint(0, 128, (16, 33)), 1 << 40, precisions=("fp32",),
                       progress=False)
    step = memfit.apply(model, opt, plan)
    try:
        longer = torch.randint(0, 128, (16, 65))
        _C.fail_allocation_after(40)  # an out-of-memory error in the middle of the longer batch's step
        loss = step(longer)
    finally:
        _C.fail_allocation_after(-1)
        memfit.remove(model)
    assert step.oom_splits >= 1
    assert torch.isfinite(torch.tensor(loss))


def test_a_hugging_face_style_cache_is_off_while_memfit_trains_and_back_on_after():
    torch.manual_seed(0)
    model = CachedLM(use_cache=True)
    batch = torch.randint(0, 128, (16, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # One micro-batch of the whole batch: the gradients are compared bit for bit with a plain step's.
    plan = memfit.plan(model, opt, lm_loss, batch, 1 << 40, precisions=("fp32",), micro_batch=16, progress=False)
    assert model.config.use_cache, "plan() leaves the model as it was"
    assert plan.never_recomputed == [], "measured with its cache off: every layer may be recomputed"
    recomputing = plan.recomputing([("layers.0", "layers.3")])
    reference = _plain_gradients(model, batch)
    step = memfit.apply(model, opt, recomputing)
    assert not model.config.use_cache
    try:
        step.gradients(batch)
        got = [p.grad.clone() for p in model.parameters()]
    finally:
        memfit.remove(model)
    assert model.config.use_cache
    for g, r in zip(got, reference):
        assert torch.equal(g, r)


def _plain_gradients(model, batch):
    model.config.use_cache = False
    try:
        model.zero_grad(set_to_none=True)
        lm_loss(model, batch).backward()
        return [p.grad.clone() for p in model.parameters()]
    finally:
        model.zero_grad(set_to_none=True)
        model.config.use_cache = True


class Broken(Exception):
    pass


def test_an_error_that_is_not_out_of_memory_reaches_the_user_as_it_was():
    torch.manual_seed(0)
    model = CachedLM(use_cache=False)
    batch = torch.randint(0, 128, (16, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    raised = Broken("the user's own error")
    calls = []

    def failing_loss(m, b):
        calls.append(1)
        if len(calls) > 2:
            raise raised
        return lm_loss(m, b)

    plan = memfit.plan(model, opt, lm_loss, batch, 1 << 40, precisions=("fp32",), micro_batch=4, progress=False)
    plan._loss_fn = failing_loss
    step = memfit.apply(model, opt, plan)
    try:
        with pytest.raises(Broken) as e:
            step(batch)
    finally:
        memfit.remove(model)
    assert e.value is raised
    assert any(frame.name == "failing_loss" for frame in e.traceback), "the user's traceback is kept"
