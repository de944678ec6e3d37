"""memfit.fit against torch.compile's activation memory budget and against halving the batch, at
one peak, on the GPT-2 written as Hugging Face's (bench/python/unnamed_models.py), CPU, torch 2.x.

torch.compile's min-cut partitioner recomputes activations in backward until the activations it
saves fit `torch._functorch.config.activation_memory_budget` (a fraction of what eager saves).
It is swept from 1.0 down; the largest fraction whose measured step peak is at or under memfit's
budget is the one compared. memfit's allocator counts every CPU tensor in the process (imported
first), so both are measured by one counter (memfit.budget's peak over two steps).

Each row: the step's measured peak, seconds from the model to its first finished step (plan or
compilation included), then samples per second (median of ROUNDS steps).

    OMP_WAIT_POLICY=passive .venv-torch2/bin/python bench/python/compile_budget.py
"""
import gc
import os
import statistics
import sys
import tempfile
import time

# A cold compilation, as a user's first run has: Inductor's caches in a folder of this run's own.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-inductor-")

import memfit  # noqa: F401  (first: its allocator counts every tensor from here on)
import torch
import torch._dynamo
import torch._functorch.config as functorch_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fit_vs_grid import halving  # noqa: E402
from unnamed_models import gpt2, plain, steps_peak  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
FRACTION = float(os.environ.get("FRACTION", "0.7"))  # memfit's budget, of the eager step's peak
SWEEP = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)


def fresh():
    torch.manual_seed(0)
    gc.collect()
    model, batch, loss_fn = gpt2()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, loss_fn


def samples_per_second(step, batch, samples):
    seconds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        step(batch)
        seconds.append(time.perf_counter() - t0)
    return samples / statistics.median(seconds)


def compiled(fraction):
    """The eager step with the model compiled under an activation budget: (peak, seconds to the
    first step, samples/s)."""
    torch._dynamo.reset()
    functorch_config.activation_memory_budget = fraction
    model, opt, batch, loss_fn = fresh()
    step = plain(torch.compile(model), opt, loss_fn, batch)
    t0 = time.perf_counter()
    step(batch)
    first = time.perf_counter() - t0
    peak = steps_peak(step, batch, 1 << 40)
    return peak, first, samples_per_second(step, batch, batch["input_ids"].size(0))


def fitted(budget, samples, precisions):
    """memfit.fit's step at the budget: (plan, peak, seconds to the first step, samples/s)."""
    model, opt, batch, loss_fn = fresh()
    t0 = time.perf_counter()
    step = memfit.fit(model, opt, loss_fn, batch, budget, precisions=precisions, progress=False)
    first = time.perf_counter() - t0
    peak = steps_peak(step, batch, 1 << 40)
    rate = samples_per_second(step, batch, samples)
    memfit.remove(model)
    return step.plan, peak, first, rate


def main():
    model, opt, batch, loss_fn = fresh()
    samples = batch["input_ids"].size(0)
    eager_step = plain(model, opt, loss_fn, batch)
    t0 = time.perf_counter()
    eager_step(batch)
    eager_first = time.perf_counter() - t0
    eager_peak = steps_peak(eager_step, batch, 1 << 40)
    eager_rate = samples_per_second(eager_step, batch, samples)
    budget = int(eager_peak * FRACTION)
    del model, opt, eager_step

    fits = [fitted(budget, samples, precisions) for precisions in (("fp32", "bf16"), ("fp32",))]

    sweep = []
    for fraction in SWEEP:
        peak, first, rate = compiled(fraction)
        sweep.append((fraction, peak, first, rate))
        print(f"compile, activation_memory_budget {fraction}: peak {peak} B, first step {first:.1f} s, "
              f"{rate:.1f} samples/s", flush=True)
        if peak <= budget:
            break
    half_first, half_s, half_acc = halving(budget)

    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; GPT-2 as Hugging Face's, batch {samples} x 128; "
          f"memfit's budget {budget} B ({FRACTION:.0%} of eager's peak, {eager_peak} B)\n")
    print("| step | configuration | peak, bytes | first step, s | samples/s |\n| --- | --- | ---: | ---: | ---: |")
    print(f"| eager (no budget) | 1 x {samples}, fp32 | {eager_peak} | {eager_first:.1f} | {eager_rate:.1f} |")
    for (plan, peak, first, rate), which in zip(fits, ("fp32 or bf16", "fp32 only")):
        print(f"| memfit.fit ({which}) | {plan.micro_batch} x {plan.accumulation}, {plan.precision}, "
              f"{len(plan.checkpointed)} of {len(plan.block_names)} blocks recomputed, {plan.optimizer_state} state | "
              f"{peak} | {first:.1f} | {rate:.1f} |")
    fraction, peak, first, rate = next(((f, p, s, r) for f, p, s, r in sweep if p <= budget), sweep[-1])
    reached = "" if peak <= budget else " (the lowest it reaches: over the budget)"
    print(f"| torch.compile (fp32) | activation_memory_budget {fraction}{reached} | {peak} | {first:.1f} | {rate:.1f} |")
    print(f"| halving on out-of-memory | {samples // half_acc} x {half_acc}, fp32 | under {budget} | {half_first:.1f} | "
          f"{samples / half_s:.1f} |")
    print("\n    OMP_WAIT_POLICY=passive .venv-torch2/bin/python bench/python/compile_budget.py"
          f"  (ROUNDS={ROUNDS} FRACTION={FRACTION})")


if __name__ == "__main__":
    main()
