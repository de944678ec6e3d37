"""The profile's peaks at a micro-batch it did not run: the highest of their moments' lines
(plan/peak_moments.h), equal to the peaks measured there."""
import torch

from memfit import _blocks
from memfit._loader import load
from memfit._parts import ModuleParts
from models import GPT, gpt_batch, gpt_loss

_C = load()

PEAKS = ("forward_peak", "forward_nograd_peak", "backward_peak", "backward_peak_accumulating")


def test_peaks_at_an_unprofiled_size_equal_the_measured_ones():
    # Shaped so that the block's backward peaks at another moment at 8 samples than at 2 and 4
    # (the MLP's hidden gradient overtakes its two weight gradients), where the line through
    # the peaks at 2 and 4 falls short.
    model = GPT(d=128, heads=4, layers=1, seq=16, dropout=0.0)
    batch = gpt_batch(batch=8, seq=16)
    tracker = _C.Tracker("cpu")
    parts = ModuleParts(model, gpt_loss, batch, _blocks.find_blocks(model), torch.device("cpu"))
    _C.profile_parts_at(parts, 8, "fp32", tracker)  # the first use of each size and op
    at = {m: _C.profile_parts_at(parts, m, "fp32", tracker) for m in (2, 4, 8)}
    fitted = _C.PrecisionProfile("fp32")
    fitted.small, fitted.large = at[2], at[4]
    for part, (f, m) in enumerate(zip(_C.block_costs_at(fitted, 8), at[8].blocks)):
        for name in PEAKS:
            assert getattr(f, name) == getattr(m, name), f"part {part}: {name}"
    for m in (2, 4):
        at[m].moments = []
    fitted.small, fitted.large = at[2], at[4]
    short = [p for p, (f, m) in enumerate(zip(_C.block_costs_at(fitted, 8), at[8].blocks)) if f.backward_peak < m.backward_peak]
    assert short, "the line through the peaks at 2 and 4 holds at 8: the test does not reach the case"
