"""Batches a DataLoader pads to their longest sequence, on Hugging Face language models built
from configs (their key/value cache on, as by default): planned at 45% of the plain peak on
16 x 96 tokens, then 50 steps of 16 samples of 24 to 192 tokens and a short last batch under
the plan's budget, each planned from its shape before it runs (plan/batch_shape.h). Prints, per
model, the out-of-memory recoveries, the worst step against the budget and against its
prediction, and the largest loss difference from the same training without memfit.

    OMP_WAIT_POLICY=passive .venv-py/bin/python bench/python/padded_batches.py
"""
import copy
import sys
import time

import torch
import transformers

import memfit

B, L0, STEPS, FRACTION = 16, 96, 50, 0.45


def models():
    common = dict(vocab_size=512, num_hidden_layers=4, num_attention_heads=4)
    gpt2 = transformers.GPT2Config(n_embd=192, n_layer=4, n_head=4, n_positions=256, vocab_size=512,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    llama = transformers.LlamaConfig(hidden_size=192, intermediate_size=512, max_position_embeddings=256,
                                     num_key_value_heads=4, **common)
    yield "GPT2LMHeadModel", transformers.GPT2LMHeadModel(gpt2)
    yield "LlamaForCausalLM", transformers.LlamaForCausalLM(llama)


def batch(samples, length, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (samples, length), generator=g)
    mask = torch.ones(samples, length, dtype=torch.long)
    mask[::3, -length // 8:] = 0  # padded tails
    # Every label counted: a micro-batch's mean is then the batch's (labels of -100 would weigh
    # micro-batches by their tokens, which a step weighing them by samples does not).
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def loss_fn(model, b):
    return model(**b).loss


def plain_step(model, opt, b):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, b)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def shapes(seed=1):
    g = torch.Generator().manual_seed(seed)
    drawn = [(B, int(torch.randint(L0 // 4, 2 * L0 + 1, (1,), generator=g))) for _ in range(STEPS - 1)]
    return drawn + [(5, L0 // 2)]


def run(name, model):
    torch.manual_seed(0)
    model.train()
    reference = copy.deepcopy(model)
    probe = copy.deepcopy(model)
    probe_opt = torch.optim.AdamW(probe.parameters(), lr=1e-4)
    with memfit.budget(1 << 40) as b:
        for _ in range(2):
            plain_step(probe, probe_opt, batch(B, L0, 0))
    budget = int(b.peak_bytes * FRACTION)
    del probe, probe_opt
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    plan = memfit.plan(model, opt, loss_fn, batch(B, L0, 0), budget, progress=False)
    planning = time.perf_counter() - start
    step = memfit.apply(model, opt, plan)
    worst_budget = worst_over = worst_under = 0.0
    losses = []
    for i, (n, length) in enumerate(shapes()):
        with memfit.budget(budget) as b:
            losses.append(step(batch(n, length, 100 + i)))
        predicted = step.last_choice["predicted_peak_bytes"]
        worst_budget = max(worst_budget, b.peak_bytes / budget)
        if i > 0:  # the first step makes the optimizer's state at its end
            error = (b.peak_bytes - predicted) / predicted
            worst_over, worst_under = max(worst_over, error), min(worst_under, error)
    memfit.remove(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    diff = max(abs(plain_step(reference, ref_opt, batch(n, length, 100 + i)) - losses[i]) / abs(losses[i])
               for i, (n, length) in enumerate(shapes()))
    print(f"| {name} | {plan.micro_batch} x {plan.accumulation}, {len(plan.checkpointed)} recomputed | "
          f"{plan.batches()['longest']} | {step.oom_splits} | {worst_budget:.1%} | {worst_over:+.2%} / {worst_under:+.2%} | "
          f"{diff:.1e} | {planning:.1f} s |", flush=True)


def main():
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; planned on {B} x {L0} at "
          f"{FRACTION:.0%}, {STEPS} batches of {B} x {L0 // 4}..{2 * L0} and a last of 5 x {L0 // 2}")
    print("| model | plan at 16 x 96 | longest at 16 | OOM recoveries | highest step / budget | "
          "measured vs predicted (worst) | loss vs plain | planning |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model in models():
        run(name, model)
    print("command: OMP_WAIT_POLICY=passive " + " ".join([sys.executable.replace(sys.prefix, sys.prefix.split("/")[-1])] + sys.argv))


if __name__ == "__main__":
    main()
