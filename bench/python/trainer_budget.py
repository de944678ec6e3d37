"""memfit inside the trainers users run, at 45% of the plain step's peak: a Hugging Face Trainer
and a PyTorch Lightning Trainer, each training a GPT-2 (Hugging Face's, from its config) for 30
steps, against the same trainer given the plan's micro-batch and accumulation by hand.

The plain step's peak: the unmodified trainer's first two steps, each under memfit.budget with
no limit (memfit's allocator counts every CPU tensor: imported first), the higher one (the
second has the optimizer's state). The budget is 45% of it. Each memfit step's peak is what
memfit.budget counted from the trainer's step begin to its end (forward, backward, optimizer).
Losses: each step's loss unrounded (the sum of what the trainer's training_step returned in
the step), against the by-hand run's; weights: the largest difference after the last step.

    OMP_WAIT_POLICY=passive .venv-torch2/bin/python bench/python/trainer_budget.py
"""
import logging
import os
import sys
import time
import warnings

import memfit  # noqa: F401  (first: its allocator counts every tensor from here on)
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tests"))
import trainer_models as tm  # noqa: E402

STEPS = int(os.environ.get("STEPS", "30"))
FRACTION = float(os.environ.get("FRACTION", "0.45"))
BATCH = 16
CONFIG = dict(layers=4, d=128, heads=4, vocab=512, seq=128)


def model():
    return tm.causal_lm(**CONFIG)


def data():
    return tm.TokenChunks(samples=BATCH * STEPS * 2, seq=CONFIG["seq"], vocab=CONFIG["vocab"])


def hugging_face():
    from memfit.integrations import transformers as hf
    dataset = data()
    plain = tm.plain_peak(model, dataset, tm.collate_chunks, BATCH)
    budget = int(plain * FRACTION)
    trainer = tm.trainer(model(), dataset, tm.collate_chunks, BATCH, STEPS)
    t0 = time.perf_counter()
    fitted = hf.fit(trainer, budget, progress=False)
    trainer.train()
    seconds = time.perf_counter() - t0
    reference = tm.by_hand(model, dataset, tm.collate_chunks, fitted.plan, STEPS)
    reference.train()
    return row("Hugging Face Trainer (transformers " + __import__("transformers").__version__ + ")", plain, budget,
               fitted.plan, fitted.peaks, fitted.step.oom_splits, trainer.step_losses(), reference.step_losses(),
               trainer.model, reference.model, seconds)


def lightning():
    import lightning.pytorch as L
    import lightning_models as lm
    from memfit.integrations.lightning import MemfitCallback
    dataset = data()
    module = lambda: lm.CausalLM(model, steps=STEPS)  # noqa: E731
    plain = lm.plain_peak(module, lm.loader(BATCH, dataset))
    budget = int(plain * FRACTION)
    callback, trained = MemfitCallback(budget, progress=False), module()
    t0 = time.perf_counter()
    lm.trainer(STEPS, [callback]).fit(trained, lm.loader(BATCH, dataset))
    seconds = time.perf_counter() - t0
    plan = callback.plan
    reference = lm.by_hand(model, plan, STEPS, lm.loader(plan.micro_batch, dataset))
    return row(f"Lightning Trainer (lightning {L.__version__})", plain, budget, plan, callback.peaks,
               callback.step.oom_splits, trained.step_losses(), reference.step_losses(plan.accumulation), trained,
               reference, seconds)


def row(name, plain, budget, plan, peaks, ooms, losses, reference_losses, trained, reference, seconds):
    loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses))
    weight_diff = max((p - q).abs().max().item() for p, q in zip(trained.parameters(), reference.parameters()))
    over = sum(p > budget for p in peaks)
    print(f"{name}: plain peak {plain} B, budget {budget} B; {plan!r}; step peaks {min(peaks)}..{max(peaks)} B, "
          f"{over} over; {ooms} out-of-memory errors", flush=True)
    return (f"| {name} | {plain} | {budget} | {plan.micro_batch} x {plan.accumulation}, {plan.precision}, "
            f"{len(plan.checkpointed)} of {len(plan.block_names)} blocks recomputed, {plan.optimizer_state} state | "
            f"{plan.predicted_peak_bytes} | {max(peaks)} | {len(peaks) - over} of {len(peaks)} | {ooms} | "
            f"{len(losses)} vs {len(reference_losses)}, {loss_diff:.2e} | {weight_diff:.2e} | {seconds:.1f} |")


def main():
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    rows = [hugging_face()]
    if torch.__version__ >= "2":
        rows.append(lightning())
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; GPT-2 {CONFIG}, batch {BATCH}, {STEPS} steps, "
          f"budget {FRACTION:.0%} of the plain step's peak\n")
    print("| trainer | plain peak, B | budget, B | plan | predicted peak, B | highest step peak, B | steps <= budget "
          "| out-of-memory | losses vs by hand: steps, max abs diff | weights: max abs diff | memfit run, s |\n"
          "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    print("\n".join(rows))
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    print(f"\n    OMP_WAIT_POLICY=passive {python} {' '.join(sys.argv)}  (STEPS={STEPS} FRACTION={FRACTION})")


if __name__ == "__main__":
    main()
