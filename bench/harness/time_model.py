#!/usr/bin/env python3
"""The planner's step-time model against measured steps (issue 16): for each shape, precision
and budget, `memfit train --replan` profiles the model, plans, prints the plan's predicted step
(forward + backward of every micro-batch, then the optimizer) and runs --steps steps; the
median of all but the first two is the measured step. The error is |predicted - measured| /
measured. Goal: within 10% for fp32 and bf16 plans.

This machine's speed drifts by tens of percent over minutes and in bursts of seconds: profile
and steps run in one process, seconds apart, and the whole thing runs --rounds times,
alternating; a row's error is the median of its rounds' errors.

    source bench/harness/quiet_env.sh && python3 bench/harness/time_model.py [--memfit build/memfit] [--threads N] [--rounds R]

Budgets are shares of each shape's plain step as predicted by a first `memfit plan` (100%: no
budget; lower ones make the plan micro-batch and recompute).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SHAPES = {
    "gpt-default": ["--model", "gpt"],
    "gpt-6x192": ["--model", "gpt", "--layers", "6", "--d-model", "192", "--heads", "6", "--seq", "96", "--batch", "24"],
    "gpt-4x128": ["--model", "gpt", "--layers", "4", "--d-model", "128", "--heads", "4", "--seq", "64", "--batch", "32"],
    "cnn": ["--model", "cnn", "--batch", "64"],
}


def plan(memfit, shape, precision, budget, cache, threads, verify=True):
    cmd = [memfit, "plan", *shape, "--precision", precision, "--budget", str(budget), "--json",
           "--profile-cache", cache, "--threads", str(threads)]
    if not verify:
        cmd.append("--no-verify")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        sys.exit(f"time_model: {' '.join(cmd)} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def train(a, shape, precision, budget, cache):
    """`memfit train --replan` at a budget: the plan it chose, the step time that plan predicted
    from the profile just taken, and the median of its steps 3 and later."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as log:
        cmd = [a.memfit, "train", *shape, "--precision", precision, "--budget", str(budget), "--replan",
               "--steps", str(a.steps), "--threads", str(a.threads), "--profile-cache", cache,
               "--eval-every", "0", "--report", "", "--no-progress", "--json-log", log.name]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"time_model: {' '.join(cmd)} failed: {out.stderr.strip()}")
        lines = [json.loads(l) for l in open(log.name) if l.strip()]
    plan_line = next(l for l in lines if l.get("type") == "plan")
    seconds = [l["seconds"] for l in lines if l.get("type") == "step"]
    c = plan_line["config"]
    what = f"{c['micro_batch']} x {c['accumulation']}, {len(c['recomputed_blocks'])} recomputed"
    return what, plan_line["predicted"]["seconds"], statistics.median(seconds[2:])


def run_round(a, cache, rows, plain_peaks):
    """One round: every row once. Each row is one `memfit train --replan`: the profile, the plan
    and the steps in one process, seconds apart, so that prediction and measurement see the
    machine at the same speed (it drifts by tens of percent over minutes here)."""
    for name in a.shapes.split(","):
        for precision in a.precisions.split(","):
            key = (name, precision)
            if key not in plain_peaks:
                first = plan(a.memfit, SHAPES[name], precision, 1 << 40, cache, a.threads, verify=False)
                plain_peaks[key] = first["plain"]["predicted_peak_bytes"]
            for share in (int(s) for s in a.shares.split(",")):
                budget = plain_peaks[key] * share // 100 if share < 100 else 1 << 40
                rows.setdefault((name, precision, share), []).append(train(a, SHAPES[name], precision, budget, cache))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memfit", default="build/memfit")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--shares", default="100,60,35")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print("command: python3 bench/harness/time_model.py " + " ".join(sys.argv[1:]))
    print(f"{os.cpu_count()} cores, {a.threads} threads, {a.rounds} rounds\n")
    rows, plain_peaks = {}, {}
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(a.rounds):
            run_round(a, cache, rows, plain_peaks)
    print("| shape | precision | budget (share of plain) | plan (each round) | predicted s | measured s | error (each round) |")
    print("|---|---|---|---|---:|---:|---:|")
    worst = {}
    for (name, precision, share), runs in rows.items():
        head = f"| {name} | {precision} | {share}% |"
        plans = ", ".join(dict.fromkeys(r[0] for r in runs))
        errors = [abs(p - m) / m for _, p, m in runs]
        error = statistics.median(errors)
        worst[precision] = max(worst.get(precision, 0), error)
        each = ", ".join(f"{100 * e:.1f}%" for e in errors)
        print(f"{head} {plans} | {statistics.median(r[1] for r in runs):.4f} | "
              f"{statistics.median(r[2] for r in runs):.4f} | {100 * error:.1f}% ({each}) |")
    print()
    for precision, error in worst.items():
        print(f"worst error (median over rounds), {precision}: {100 * error:.1f}% (goal <= 10%)")


if __name__ == "__main__":
    main()
