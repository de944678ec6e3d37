#!/usr/bin/env python3
"""The Python package on a GPU (run by bench/harness/gpu_allocator_check.py): memfit.fit on the
GPT-2 written as Hugging Face's (bench/python/unnamed_models.py) at 60% and 45% of its plain
step's max_memory_reserved (plus the memory outside the caching allocator), then STEPS steps
under memfit.budget: the allocator's reserved peak, retries and out-of-memory errors, and the
step's recoveries. Prints the rows as one JSON list, in gpu_allocator_check.py's form.

    python3 bench/harness/gpu_python_check.py [--device cuda] [--steps 20]
"""
import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import memfit  # noqa: E402  (first memfit, then the model: its allocator counts every tensor)
from unnamed_models import gpt2  # noqa: E402


def counters(device):
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {"reserved": s.get("reserved_bytes.all.peak", 0), "allocated": s.get("allocated_bytes.all.peak", 0),
            "retries": s.get("num_alloc_retries", 0), "ooms": s.get("num_ooms", 0)}


def plain_reserved(device):
    torch.manual_seed(0)
    model, batch, loss_fn = gpt2()
    model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with memfit.budget(1 << 40, device) as b:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            opt.step()
    return counters(device).get("reserved", b.peak_bytes)


def row(device, share, plain, steps):
    torch.manual_seed(0)
    gc.collect()
    model, batch, loss_fn = gpt2()
    model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = memfit._budget.outside_bytes(device) + int(share * plain)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step = memfit.fit(model, opt, loss_fn, batch, budget, progress=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with memfit.budget(budget, device) as b:
        for _ in range(steps):
            step(batch)
    memfit.remove(model)
    c = counters(device)
    p = step.plan
    r = {"config": "Python GPT-2 (HF-style) " + p.precision, "budget": f"{budget / (1 << 20):.1f}",
         "what": f"memfit.fit, {steps} steps: {p.micro_batch} x {p.accumulation}, {len(p.checkpointed)} recomputed",
         "pred_allocated": p.predicted_peak_bytes, "recoveries": step.oom_splits,
         "reserved": c.get("reserved", b.peak_bytes), "allocated": c.get("allocated", b.peak_bytes),
         "retries": c.get("retries", 0), "ooms": c.get("ooms", 0)}
    r["pass"] = r["retries"] == 0 and r["ooms"] == 0 and r["recoveries"] == 0 and b.peak_bytes <= budget
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    plain = plain_reserved(device)
    print(json.dumps([row(device, share, plain, a.steps) for share in (0.6, 0.45)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
