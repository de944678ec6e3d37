"""An optimizer that has stepped already, under a plan that keeps 8-bit state: its Adam moments
are carried into memfit.Adam8bit (within the 8-bit codes' error bound, the step counts kept),
its fp32 moments are released before the first planned step, and that step fits the budget.
memfit.remove gives them back: the user's AdamW steps on from the moments the 8-bit one read."""
import copy
import gc

import torch

import memfit
from memfit._loader import load
from models import make
from test_plan_apply import plain_step

_C = load()


def test_8bit_plan_carries_the_moments_over_and_releases_the_fp32_state():
    torch.manual_seed(0)
    model, batch, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        plain_step(model, opt, loss_fn, batch)
    with memfit.budget(1 << 40) as b:
        plain_step(model, opt, loss_fn, batch)
    budget = int(b.peak_bytes * 0.8)
    fp32 = {p: (s["exp_avg"].clone(), s["exp_avg_sq"].clone(), int(float(s["step"]))) for p, s in opt.state.items()}
    watches = [_C.StorageWatch(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    plan = memfit.plan(model, opt, loss_fn, batch, budget, precisions=("fp32",), optimizer_state="8bit", progress=False)
    step = memfit.apply(model, opt, plan)
    try:
        assert isinstance(step.optimizer, memfit.Adam8bit) and step.optimizer is not opt
        assert not any(opt.state.values()), "the user's optimizer keeps no state: the fp32 moments are released"
        gc.collect()
        assert not any(w.alive() for w in watches), "no fp32 moment of the user's optimizer is alive"
        bound_m, bound_v = _C.Adam8bit.max_error(True), _C.Adam8bit.max_error(False)
        quantized = 0
        for p, (m, v, n) in fp32.items():
            s = step.optimizer.state[p]
            assert int(s["step"]) == n
            if "exp_avg_codes" not in s:  # small tensors keep fp32 moments, exactly
                assert torch.equal(s["exp_avg"], m) and torch.equal(s["exp_avg_sq"], v)
                continue
            quantized += 1
            for codes, absmax, moment, signed, bound in ((s["exp_avg_codes"], s["exp_avg_absmax"], m, True, bound_m),
                                                         (s["exp_avg_sq_codes"], s["exp_avg_sq_absmax"], v, False, bound_v)):
                back = _C.dequantize_8bit(codes, absmax, signed)
                per_value = absmax.repeat_interleave(2048)[: moment.numel()]
                assert torch.all((back - moment.reshape(-1)).abs() <= per_value * bound * (1 + 1e-5) + 1e-12)
        assert quantized > 0
        with memfit.budget(budget) as b:
            step(batch)
        assert step.oom_splits == 0 and b.peak_bytes <= budget
    finally:
        memfit.remove(model)


def moments_read_by_8bit_step(state, shape):
    """(exp_avg, exp_avg_sq) as an Adam8bit's next step reads them: dequantized, or kept in fp32."""
    if "exp_avg_codes" not in state:
        return state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    return (_C.dequantize_8bit(state["exp_avg_codes"], state["exp_avg_absmax"], True).view(shape),
            _C.dequantize_8bit(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], False).view(shape))


def within_8bit_bound(codes, absmax, moment, signed):
    """Whether an 8-bit moment is within its block's absmax times the map's max_error of `moment`,
    torch's fp32 one: the two steps compute the moment in their own order (the 8-bit one fused),
    so they differ by their fp32 rounding too, a few ulps of that absmax."""
    back = _C.dequantize_8bit(codes, absmax, signed)
    per_value = absmax.repeat_interleave(2048)[: moment.numel()]
    bound = _C.Adam8bit.max_error(signed) + 4 * torch.finfo(torch.float32).eps
    return bool(torch.all((back - moment.reshape(-1)).abs() <= per_value * bound))


def test_removing_an_8bit_plan_gives_the_adamw_its_moments_and_step_counts_as_torch_keeps_them():
    model, batch, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_step(model, opt, loss_fn, batch)
    torch_step = next(iter(opt.state.values()))["step"]  # a step count as this torch keeps it
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 40, precisions=("fp32",), optimizer_state="8bit",
                       micro_batch=512, progress=False)
    step = memfit.apply(model, opt, plan)
    for _ in range(3):
        step(batch)
    eight = step.optimizer
    read = {p: moments_read_by_8bit_step(eight.state[p], p.shape) for p in model.parameters()}
    saved = copy.deepcopy(eight.state_dict())  # (torch 2.x's load_state_dict keeps the tensors it is given)
    assert memfit.remove(model)
    twin = copy.deepcopy(model)  # the 8-bit optimizer stepping on, to compare with
    twin_eight = memfit.Adam8bit(twin.parameters(), lr=1e-3)
    twin_eight.load_state_dict(saved)
    assert not eight.state, "the 8-bit state left as it was given"
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [list(map(id, model.parameters()))]
    for p in model.parameters():
        s = opt.state[p]
        assert type(s["step"]) is type(torch_step) and float(s["step"]) == 4
        if torch.is_tensor(torch_step):
            assert (s["step"].dtype, s["step"].shape, s["step"].device) == (torch_step.dtype, torch_step.shape,
                                                                              torch_step.device)
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(s["exp_avg"], read[p][0]) and torch.equal(s["exp_avg_sq"], read[p][1])
    plain_step(model, opt, loss_fn, batch)  # the user's AdamW steps on, and the 8-bit one beside it
    plain_step(twin, twin_eight, loss_fn, batch)
    quantized = 0
    for p, q in zip(model.parameters(), twin.parameters()):
        s, t = opt.state[p], twin_eight.state[q]
        assert float(s["step"]) == int(t["step"]) == 5
        if "exp_avg_codes" not in t:  # small tensors: both AdamW's fp32 arithmetic (torch 2.x's in another order)
            for a, b in ((s["exp_avg"], t["exp_avg"]), (s["exp_avg_sq"], t["exp_avg_sq"]), (p, q)):
                scale = float(a.abs().max())  # (the rounding of its largest terms, not its own)
                assert torch.allclose(a, b, rtol=0, atol=8 * torch.finfo(torch.float32).eps * scale), (a - b).abs().max()
            continue
        quantized += 1
        assert within_8bit_bound(t["exp_avg_codes"], t["exp_avg_absmax"], s["exp_avg"], True)
        assert within_8bit_bound(t["exp_avg_sq_codes"], t["exp_avg_sq_absmax"], s["exp_avg_sq"], False)
    assert quantized > 0
