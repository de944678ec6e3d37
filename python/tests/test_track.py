"""memfit.track: exact bytes by category, from the tensors themselves."""
import json

import pytest
import torch
from torch import nn

import memfit


def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def state_tensors(optimizer):
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def model_and_data(samples=2):
    """Weights heavier than activations: the step's peak comes with every gradient alive."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    x, y = torch.randn(samples, 64), torch.randn(samples, 8)
    return model, x, y


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_categories_are_the_tensors_bytes_exactly(name):
    model, x, y = model_and_data()
    opt = OPTIMIZERS[name](model.parameters())
    for _ in range(2):  # the state exists; the second step is the one measured
        with memfit.track(model=model, optimizer=opt) as t:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    params = list(model.parameters())
    assert t.categories["weights"] == storage_bytes(params)
    assert t.categories["gradients"] == storage_bytes(params)  # the peak comes with every gradient alive
    assert t.categories["optimizer_state"] == storage_bytes(state_tensors(opt))
    assert sum(t.categories.values()) == t.peak_bytes
    assert t.phase in ("backward", "optimizer")


def test_gradients_released_inside_the_block_still_count_at_the_peak():
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters())
    with memfit.track(model=model, optimizer=opt) as t:
        for _ in range(2):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    assert sum(t.categories.values()) == t.peak_bytes
    assert t.categories["optimizer_state"] == storage_bytes(state_tensors(opt))
    assert t.categories["weights"] == storage_bytes(list(model.parameters()))


def test_phase_and_module_at_the_peak_and_reports(tmp_path):
    model = nn.Sequential(nn.Linear(32, 4096), nn.ReLU(), nn.Linear(4096, 32))
    x = torch.randn(64, 32)
    with memfit.track(model=model) as t:
        model(x).square().mean().backward()
    assert t.phase in ("forward", "backward")
    assert t.module is not None
    assert t.module in {name or "Sequential" for name, _ in model.named_modules()}
    data = json.loads(t.to_json())
    assert data["peak_bytes"] == t.peak_bytes and set(data["categories"]) == {
        "weights", "gradients", "optimizer_state", "activations", "other"}
    page = tmp_path / "track.html"
    t.save_html(page)
    html = page.read_text()
    assert 'id="timeline-chart"' in html and f'data-bytes="{t.peak_bytes}"' in html


def test_no_grad_keeps_no_activations():
    """The lesson's first tactic: evaluation under torch.no_grad keeps nothing for backward."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])
    x = torch.randn(256, 256)
    with memfit.track(model=model) as with_grad:
        out = model(x)
        del out
    with memfit.track(model=model) as no_grad, torch.no_grad():
        out = model(x)
        del out
    assert no_grad.peak_bytes < with_grad.peak_bytes
    assert with_grad.peak_bytes - no_grad.peak_bytes >= 6 * 256 * 256 * 4


def test_an_offloaded_optimizers_bytes_count_as_the_hosts():
    """Around the steps of an offloaded plan, memfit.track counts the device as memfit.budget does:
    the host masters and the state live in memfit's host space, not the device's."""
    from models import make

    model, batch, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), optimizer_state="fp32",
                       micro_batch=512, offload="optimizer", progress=False)
    step = memfit.apply(model, opt, plan)
    try:
        step(batch)  # the state exists now, on the host
        # The device bytes the tracker does not know of: the batch, and whatever else this process holds.
        unknown = memfit.allocated_bytes() - storage_bytes(list(model.parameters()))
        with memfit.budget(1 << 40) as b, memfit.track(model=model, optimizer=opt) as t:
            step(batch)
    finally:
        memfit.remove(model)
    assert t.peak_bytes == b.peak_bytes - unknown
    assert t.categories["optimizer_state"] == 0, "the state is the host's"


def test_track_rejects_what_is_not_a_model():
    with pytest.raises(ValueError, match="model"):
        memfit.track(model=3)


class _Twice(torch.autograd.Function):
    """A user's own autograd function: its apply asks LibTorch whether a profiler is on."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_an_autograd_function_runs_under_the_tracker_and_its_bytes_count():
    """The tracker sits where LibTorch looks for a profiler (a profiler that is off): a custom
    autograd function runs under it, and what it makes is counted."""
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    _Twice.apply(layer(x)).sum().backward()
    reference = layer.weight.grad
    layer.weight.grad = None
    with memfit.track(model=layer) as t:
        out = _Twice.apply(layer(x))
        out.sum().backward()
    assert torch.equal(layer.weight.grad, reference)
    assert t.peak_bytes >= 2 * 64 * 256 * 4  # the layer's output and the function's, both alive
