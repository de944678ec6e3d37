"""Why memfit refuses a compiled model (memfit._compiled), measured on the tests' GPT (2 blocks,
d=64, seq 64, batch 16) with each block's forward compiled, torch 2.x, CPU.

1. What memfit.plan says for it: the ValueError naming the compiled part.
2. What the refusal prevents, with the check switched off here: planned from the eager blocks
   (compilation forced off while memfit measures), stepped compiled. The step stays under the
   budget, but its peak is not the one predicted, so the plan is not the one the budget allows.

    OMP_WAIT_POLICY=passive .venv-torch2/bin/python bench/python/compile_refused.py
"""
import os
import sys

import memfit  # noqa: F401  (first: its allocator counts every tensor from here on)
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tests"))
from models import GPT, gpt_batch, gpt_loss  # noqa: E402

def compiled_gpt():
    torch.manual_seed(0)
    model = GPT(layers=2, d=64, seq=64)
    for block in model.h:
        block.forward = torch.compile(block.forward, dynamic=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def plain_peak(model, opt):
    with memfit.budget(1 << 40) as b:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            gpt_loss(model, gpt_batch(16)).backward()
            opt.step()
    opt.zero_grad(set_to_none=True)
    return b.peak_bytes


def refusal(model, opt):
    try:
        memfit.plan(model, opt, gpt_loss, gpt_batch(16), "1GiB", progress=False)
    except ValueError as e:
        return str(e)
    return "(no error)"


def unchecked(fraction, plain):
    """Planned with the check off and compilation forced off, then stepped compiled."""
    import memfit._apply
    import memfit._blocks
    memfit._blocks.check_not_compiled = memfit._apply.check_not_compiled = lambda model, name="model": None
    model, opt = compiled_gpt()
    budget = int(plain * fraction)
    with torch.compiler.set_stance("force_eager"):
        plan = memfit.plan(model, opt, gpt_loss, gpt_batch(16), budget, progress=False)
    step = memfit.apply(model, opt, plan)
    with memfit.budget(budget) as b:
        for _ in range(3):
            step(gpt_batch(16))
    memfit.remove(model)
    error = (plan.predicted_peak_bytes - b.peak_bytes) / b.peak_bytes
    return (f"| {fraction:.0%} | {budget} | {plan.micro_batch} x {plan.accumulation}, {len(plan.checkpointed)} of "
            f"{len(plan.block_names)} blocks recomputed, {plan.optimizer_state} state | {plan.predicted_peak_bytes} | "
            f"{b.peak_bytes} | {error:+.1%} | {step.oom_splits} |")


def main():
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    model, opt = compiled_gpt()
    plain = plain_peak(model, opt)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; the compiled step's plain peak: {plain} B\n")
    print(f"1. memfit.plan: {refusal(model, opt)}\n")
    print("2. with the check off: planned eager, stepped compiled (3 steps)\n")
    print("| budget | bytes | plan | predicted peak, B | measured peak, B | prediction error | out-of-memory |\n"
          "| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for fraction in (0.6, 0.45):
        print(unchecked(fraction, plain), flush=True)
    print("\n    OMP_WAIT_POLICY=passive .venv-torch2/bin/python bench/python/compile_refused.py")


if __name__ == "__main__":
    main()
