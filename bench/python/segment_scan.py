"""Every one- and two-name segment set of a model that is not a chain, recomputed as
`plan.recomputing` gives it: the peak memfit.budget measures over two steps against the peak the
plan predicts, error = (measured - predicted) / predicted. The models: the tests' U-Net (skips kept
by the code between blocks), Hugging Face's T5 (a position bias made by each stack's first block
and handed to the later ones) and the tests' T5-like stack. Prints one markdown table per model
and the largest errors each way.

    OMP_WAIT_POLICY=passive .venv-py/bin/python bench/python/segment_scan.py [unet] [t5] [biased]
"""
import os
import sys

import torch

import memfit

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "tests"))
from model_kinds import hf_t5  # noqa: E402
from models import make  # noqa: E402

MODELS = {"unet": (lambda: make("unet"), 8), "t5": (hf_t5, 16), "biased": (lambda: make("biased"), 8)}


def peak_of(step, batch):
    with memfit.budget(1 << 40) as b:
        for _ in range(2):  # the first makes the optimizer's state
            step(batch)
    return b.peak_bytes


def scan(name):
    make_model, micro_batch = MODELS[name]
    torch.manual_seed(0)
    model, batch, loss_fn = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, opt, loss_fn, batch, "1GiB", precisions=("fp32",), micro_batch=micro_batch,
                       optimizer_state="fp32", progress=False)
    names = plan.block_names
    cases = [[]] + [[n] for n in names] + [[(names[i], names[j])] for i in range(len(names)) for j in range(i + 1, len(names))]
    print(f"\n{name}: micro-batch {micro_batch}, fp32, AdamW (fp32 state)\n")
    print("| segments | predicted bytes | measured bytes | error |\n| --- | ---: | ---: | ---: |")
    errors = []
    for segments in cases:
        p = plan.recomputing(segments)
        step = memfit.apply(model, opt, p)
        try:
            measured = peak_of(step, batch)
        finally:
            memfit.remove(model)
        error = (measured - p.predicted_peak_bytes) / p.predicted_peak_bytes
        errors.append(error)
        shown = ", ".join(s if isinstance(s, str) else f"{s[0]}..{s[1]}" for s in segments) or "none"
        print(f"| {shown} | {p.predicted_peak_bytes} | {measured} | {error:+.2%} |", flush=True)
    print(f"\n{name}: {len(cases)} sets, error from {min(errors):+.2%} to {max(errors):+.2%}")


def main():
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("command: OMP_WAIT_POLICY=passive python bench/python/segment_scan.py " + " ".join(sys.argv[1:]))
    for name in sys.argv[1:] or list(MODELS):
        scan(name)


if __name__ == "__main__":
    main()
