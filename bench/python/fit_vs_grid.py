"""memfit.fit against hand-written PyTorch at the same budget, CPU, on a model no test names:
the GPT-2 written as Hugging Face's (bench/python/unnamed_models.py) or Hugging Face's
LlamaForCausalLM built from a config (its cache off, as Hugging Face's own checkpointing turns
it off). At each budget (a share of the plain step's peak):

1. the grid a person would try by hand — accumulation (1, 2, 4, 8) x the first k blocks
   checkpointed with torch.utils.checkpoint (k = 0..layers) x precision (fp32, bf16 autocast) —
   each configuration's peak under memfit.budget, the fitting ones timed one after another;
2. memfit's step, its configuration written by hand (the overhead of memfit's wrappers), the
   grid's three fastest and the plain step (no budget), each on its own copy of the model, timed
   together in rounds (the order rotated; medians): a machine whose speed drifts over minutes
   weighs on each alike. The time model is judged by memfit's step over the plain step, predicted
   and measured (drift cancels in a ratio of runs taken together);
3. memfit.plan's seconds against plain steps' (five timed before planning, five after);
4. halving on out-of-memory from the full batch (find_executable_batch_size-style: the step under
   the budget, the micro-batch halved on each out-of-memory error) against memfit.fit: seconds to
   the first successful step, then samples per second.

    OMP_WAIT_POLICY=passive .venv-py/bin/python bench/python/fit_vs_grid.py [gpt2|llama] [FRACTION ...]
"""
import contextlib
import gc
import os
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memfit  # noqa: E402
from unnamed_models import gpt2, plain, steps_peak  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "7"))  # timed steps per configuration (medians)


def llama():
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=192, intermediate_size=512, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    ids = torch.randint(0, 512, (16, 128))
    mask = torch.ones(16, 128, dtype=torch.long)
    mask[::4, -16:] = 0
    return (transformers.LlamaForCausalLM(config), {"input_ids": ids, "attention_mask": mask, "labels": ids},
            lambda m, b: m(**b, use_cache=False).loss)


# name -> (make, its repeated blocks, what the tables call it)
MODELS = {"gpt2": (gpt2, lambda m: m.h, "GPT-2 written as Hugging Face's, 6 layers, batch 16 x 128"),
          "llama": (llama, lambda m: m.model.layers, "Hugging Face LlamaForCausalLM, 6 layers, d 192, batch 16 x 128")}
MODEL = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
if MODEL not in MODELS:
    sys.exit(f"fit_vs_grid: model {MODEL!r}: expected one of {', '.join(MODELS)}")
MAKE, BLOCKS, LABEL = MODELS[MODEL]
LAYERS = 6  # both models' blocks: the grid checkpoints the first 0..LAYERS


def fresh():
    torch.manual_seed(0)
    gc.collect()
    model, batch, loss_fn = MAKE()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, loss_fn


@contextlib.contextmanager
def checkpointed(blocks):
    for block in blocks:
        block.forward = lambda *a, run=block.forward, **k: checkpoint(run, *a, use_reentrant=False, **k)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def hand_step(model, opt, loss_fn, accumulation, k, precision):
    """One optimizer step written by hand: micro-batches, blocks checkpointed (the first k, or
    those whose indices k lists), autocast."""
    def step(batch):
        n = batch["input_ids"].size(0)
        micro = n // accumulation
        opt.zero_grad(set_to_none=True)
        with checkpointed([BLOCKS(model)[i] for i in (range(k) if isinstance(k, int) else k)]):
            for i in range(0, n, micro):
                part = {key: v[i:i + micro] for key, v in batch.items()}
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = loss_fn(model, part) * (micro / n)
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def seconds(step, batch):
    t0 = time.perf_counter()
    step(batch)
    return time.perf_counter() - t0


def median_seconds(step, batch, rounds=ROUNDS):
    step(batch)
    return statistics.median(seconds(step, batch) for _ in range(rounds))


def in_rounds(steps, batch):
    """Median seconds of each step (name -> step), all run in rounds with the order rotated each
    round, so that a machine's speed drifting over minutes weighs on every one alike."""
    names = list(steps)
    for name in names:
        steps[name](batch)  # first use
    runs = {name: [] for name in names}
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(seconds(steps[name], batch))
    return {name: statistics.median(v) for name, v in runs.items()}


def grid(budget):
    """(seconds, configuration) of every grid configuration that fits the budget, and what was
    left untimed: bf16 is timed only where one step of it (after its first) runs within 2x the
    fastest fp32 configuration, as a person would drop a precision many times slower."""
    fits = []
    for precision in ("fp32", "bf16"):
        if precision == "bf16":
            probe = one_step_seconds(8, precision)
            if fits and probe > 2 * min(fits)[0]:
                return fits, f"bf16 not timed: a step took {probe:.2f} s, {probe / min(fits)[0]:.1f}x the fastest fp32"
        for accumulation in (1, 2, 4, 8):
            for k in range(LAYERS + 1):
                model, opt, batch, loss_fn = fresh()
                step = hand_step(model, opt, loss_fn, accumulation, k, precision)
                step(batch)  # the optimizer's state exists
                try:
                    steps_peak(step, batch, budget)
                except RuntimeError as e:
                    if "out of memory" not in str(e):
                        raise
                    continue
                fits.append((median_seconds(step, batch), (accumulation, k, precision)))
    return fits, ""


def one_step_seconds(accumulation, precision):
    model, opt, batch, loss_fn = fresh()
    step = hand_step(model, opt, loss_fn, accumulation, 0, precision)
    step(batch)  # first use
    return seconds(step, batch)


def halving(budget):
    """Seconds to the first step that fits, halving the micro-batch on each out-of-memory error
    (also one in a later step: the optimizer's state is made by the first), then the median step."""
    model, opt, batch, loss_fn = fresh()
    t0 = time.perf_counter()
    accumulation, first = 1, None
    with memfit.budget(budget):
        while True:
            step = hand_step(model, opt, loss_fn, accumulation, 0, "fp32")
            try:
                step(batch)
                first = first or time.perf_counter() - t0
                return first, median_seconds(step, batch), accumulation
            except RuntimeError as e:
                if "out of memory" not in str(e) or accumulation >= batch["input_ids"].size(0):
                    raise
                accumulation *= 2


def at_budget(fraction, peak):
    """The tables' rows at one budget: memfit's step against the grid's three fastest and its own
    configuration by hand, timed together in rounds; planning against plain steps timed around
    it; halving."""
    budget = int(peak * fraction)
    plain_model, plain_opt, batch, loss_fn = fresh()
    plain_step = plain(plain_model, plain_opt, loss_fn, batch)
    plain_step(batch)
    plain_s = sum(seconds(plain_step, batch) for _ in range(5))
    model, opt, batch, loss_fn = fresh()
    samples = batch["input_ids"].size(0)
    t0 = time.perf_counter()
    plan = memfit.plan(model, opt, loss_fn, batch, budget, progress=False)
    planning = time.perf_counter() - t0
    step = memfit.apply(model, opt, plan, budget=budget)
    step(batch)  # the first step, as memfit.fit verifies it
    fit_first = time.perf_counter() - t0
    plain_s = (plain_s + sum(seconds(plain_step, batch) for _ in range(5))) / 10  # before and after planning
    del plain_model, plain_opt, plain_step

    fits, untimed = grid(budget)
    top = [config for _, config in sorted(fits)[:3]]
    indices = [plan.block_names.index(n) for n in plan.checkpointed]
    configs = {"memfit": None, "memfit's configuration by hand": (plan.accumulation, indices, plan.precision),
               "plain": (1, 0, "fp32"), **{c: c for c in top}}
    steps = {}
    for name, config in configs.items():
        if config is None:
            steps[name] = step
        else:
            m, o, _, _ = fresh()
            steps[name] = hand_step(m, o, loss_fn, *config)
    step.budget = 1 << 40  # the plan verified; the hard budget would count the other copies alive beside it
    medians = in_rounds(steps, batch)
    ours_s = medians["memfit"]
    memfit.remove(model)
    del steps, step, model, opt
    gc.collect()  # the copies timed together: the hard budget of halving counts every live byte
    print(f"\n### {fraction:.0%} of the plain peak: budget {budget / 2**20:.1f} MiB\n")
    print("| what | configuration | step s (median) | vs memfit |\n| --- | --- | ---: | ---: |")
    print(f"| memfit's step | {plan.micro_batch} x {plan.accumulation}, {len(plan.checkpointed)}/{len(plan.block_names)} "
          f"blocks recomputed, {plan.precision}, {plan.optimizer_state} state (predicted {plan.predicted_step_seconds:.3f} s) "
          f"| {ours_s:.3f} | 1.00 |")
    hand_s = medians["memfit's configuration by hand"]
    print(f"| memfit's configuration by hand | the same, torch's AdamW | {hand_s:.3f} | {hand_s / ours_s:.2f} |")
    tried = 4 * (LAYERS + 1) * (1 if untimed else 2)
    for rank, (acc, k, prec) in enumerate(top, 1):
        t = medians[(acc, k, prec)]
        print(f"| hand-written grid, fastest #{rank} alone ({len(fits)} of {tried} fit) | {samples // acc} x {acc}, first {k} "
              f"blocks checkpointed, {prec} | {t:.3f} | {t / ours_s:.2f} |")
    plain_round_s = medians["plain"]
    print(f"| the plain step, no budget (the time model's reference) | {samples} x 1, fp32 | {plain_round_s:.3f} | "
          f"{plain_round_s / ours_s:.2f} |")
    predicted_ratio = plan.predicted_step_seconds / plan.plain_predicted_step_seconds
    measured_ratio = ours_s / plain_round_s
    print(f"\nmemfit's step over the plain step: predicted {predicted_ratio:.3f}x, measured {measured_ratio:.3f}x in the "
          f"same rounds ({measured_ratio / predicted_ratio - 1:+.1%}); absolute: predicted {plan.predicted_step_seconds:.3f} s, "
          f"measured {ours_s:.3f} s ({ours_s / plan.predicted_step_seconds - 1:+.1%}, the machine's speed then and now in it)")
    if untimed:
        print(f"\n{untimed}")
    sys.stdout.flush()  # the table so far, before the halving runs
    half_first, half_s, half_acc = halving(budget)
    print("\n| from the full batch | seconds | in plain steps | samples/s after |\n| --- | ---: | ---: | ---: |")
    print(f"| memfit.plan | {planning:.1f} | {planning / plain_s:.1f} | |")
    print(f"| memfit.plan + apply + the first step | {fit_first:.1f} | {fit_first / plain_s:.1f} | {samples / ours_s:.1f} |")
    print(f"| halving on out-of-memory (ended at {half_acc} micro-batches, fp32) | {half_first:.1f} | "
          f"{half_first / plain_s:.1f} | {samples / half_s:.1f} |", flush=True)


def main():
    fractions = [float(f) for f in sys.argv[2:]] or [0.45]
    model, opt, batch, loss_fn = fresh()
    peak = steps_peak(plain(model, opt, loss_fn, batch), batch, 1 << 40)
    del model, opt
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {LABEL}; plain peak {peak / 2**20:.1f} MiB; "
          f"{ROUNDS} rounds")
    print(f"`OMP_WAIT_POLICY=passive {sys.executable} {' '.join(sys.argv)}`")
    for fraction in fractions:
        at_budget(fraction, peak)


if __name__ == "__main__":
    main()
