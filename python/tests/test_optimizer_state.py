"""An optimizer that has stepped already, under a plan that keeps 8-bit state: its Adam moments
are carried into memfit.Adam8bit (within the 8-bit codes' error bound, the step counts kept),
its fp32 moments are released before the first planned step, and that step fits the budget."""
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
