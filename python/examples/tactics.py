"""The lesson's memory tactics, each measured with memfit.track() on the quickstart's TinyLM (CPU):
prints the table in docs/python.md. `python python/examples/tactics.py`"""
import os
import sys

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memfit  # noqa: E402
from quickstart import TinyLM, make_batch  # noqa: E402

torch.manual_seed(0)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = make_batch(32)
MiB = 1 << 20


def loss_of(b):
    return model(**b)["loss"]


def train_step(b, micro=None, precision=None):
    opt.zero_grad(set_to_none=True)
    parts = [b] if micro is None else [{k: v[i:i + micro] for k, v in b.items()} for i in range(0, 32, micro)]
    for part in parts:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of(part) * (len(part["labels"]) / 32)
        loss.backward()
    opt.step()


def checkpointed_step(b):
    for layer in model.layers:
        layer.forward = lambda x, attention_mask, run=layer.forward: checkpoint(run, x, attention_mask,
                                                                                 use_reentrant=False)
    try:
        train_step(b)
    finally:
        for layer in model.layers:
            del layer.forward


def tracked(fn):
    with memfit.track(model=model, optimizer=opt) as t:
        fn()
    return t


train_step(batch)  # the optimizer's state exists from here on
rows = []
plain = tracked(lambda: train_step(batch))
c = plain.categories
rows.append(("Where memory goes: the plain step (batch 32)", plain.peak_bytes,
             f"weights {c['weights'] / MiB:.1f}, gradients {c['gradients'] / MiB:.1f}, optimizer state "
             f"{c['optimizer_state'] / MiB:.1f}, activations {c['activations'] / MiB:.1f} MiB, in {plain.phase}"))
rows.append(("Shrink the batch: 4 micro-batches of 8, accumulated", tracked(lambda: train_step(batch, micro=8)).peak_bytes,
             "the same step: gradients accumulate over the micro-batches"))
with_grad = tracked(lambda: loss_of(batch))
rows.append(("No grad for inference: forward, grad on", with_grad.peak_bytes, ""))
with torch.no_grad():
    rows.append(("... under torch.no_grad()", tracked(lambda: loss_of(batch)).peak_bytes, "nothing kept for backward"))
rows.append(("Mixed precision: the step under bf16 autocast", tracked(lambda: train_step(batch, precision="bf16")).peak_bytes,
             "activations kept in bf16"))
ckpt = tracked(lambda: checkpointed_step(batch))
rows.append(("Checkpointing: every layer through torch.utils.checkpoint", ckpt.peak_bytes, "recomputed in backward"))


def evaluate(log_by_value):
    total = 0.0
    for i in range(4):
        loss = loss_of(make_batch(8, seed=i))
        total += loss.item() if log_by_value else loss  # a tensor keeps each batch's graph alive
    return total


rows.append(("Detach what you log: 4 eval batches summed as tensors", tracked(lambda: evaluate(False)).peak_bytes, ""))
rows.append(("... summed with loss.item()", tracked(lambda: evaluate(True)).peak_bytes, ""))
opt.zero_grad(set_to_none=False)
kept = memfit.allocated_bytes()
opt.zero_grad(set_to_none=True)
rows.append(("set_to_none: bytes freed between steps by zero_grad(set_to_none=True)", kept - memfit.allocated_bytes(),
             "the gradients"))

print("| tactic | memfit.track() peak | note |\n| --- | ---: | --- |")
for what, n, note in rows:
    print(f"| {what} | {n / MiB:.1f} MiB | {note} |")
