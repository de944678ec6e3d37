#!/usr/bin/env python3
"""The planner's step-time model against measured steps (issue 16): for each shape, precision
and budget, `memfit plan --json` predicts one whole step (forward + backward of every
micro-batch, then the optimizer); `memfit train`, pinned to that plan (micro-batch, blocks
recomputed, precision), runs --steps steps and the median of all but the first two is that
run's step. The error is |predicted - measured| / measured. Goal: within 10% for fp32 and bf16 plans.

This machine's speed drifts by tens of percent over minutes and in bursts of seconds, so the
whole thing runs --rounds times: each round profiles every shape afresh (--replan) and
measures its plans right after; a row's error is the median of its rounds' errors.

    source bench/quiet_env.sh && python3 bench/time_model.py [--memfit build/memfit] [--threads N] [--rounds R]

Budgets are shares of each shape's plain step as predicted (100%: nothing recomputed; lower
ones make the plan micro-batch and recompute). Within a round every budget is planned from
that round's profile (the profile cache, in a temporary directory).
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


def measure(memfit, shape, config, cache, threads, steps):
    """The median seconds of steps 3.. of `memfit train` pinned to the plan's configuration."""
    recomputed = ",".join(str(b) for b in config["recomputed_blocks"]) or "none"
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as log:
        cmd = [memfit, "train", *shape, "--precision", config["precision"], "--micro-batch", str(config["micro_batch"]),
               "--checkpoint", recomputed, "--budget", str(1 << 40), "--steps", str(steps), "--threads", str(threads),
               "--profile-cache", cache, "--eval-every", "0", "--report", "", "--no-progress", "--json-log", log.name]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"time_model: {' '.join(cmd)} failed: {out.stderr.strip()}")
        seconds = [json.loads(l)["seconds"] for l in open(log.name) if '"type":"step"' in l.replace(" ", "")]
    return statistics.median(seconds[2:])


def run_round(a, cache, rows):
    """One round: each shape and precision profiled afresh (--replan), its budgets planned from
    that profile and each plan measured at once, so that prediction and measurement see the
    machine at the same speed (it drifts by tens of percent over minutes here)."""
    for name in a.shapes.split(","):
        for precision in a.precisions.split(","):
            first = plan(a.memfit, SHAPES[name] + ["--replan"], precision, 1 << 40, cache, a.threads, verify=False)
            plain = first["plain"]["predicted_peak_bytes"]
            for share in (int(s) for s in a.shares.split(",")):
                budget = plain * share // 100 if share < 100 else 1 << 40
                p = plan(a.memfit, SHAPES[name], precision, budget, cache, a.threads, verify=False)
                row = rows.setdefault((name, precision, share), [])
                if not p["feasible"]:
                    row.append(None)
                    continue
                c = p["config"]
                what = f"{c['micro_batch']} x {c['accumulation']}, {len(c['recomputed_blocks'])} recomputed"
                measured = measure(a.memfit, SHAPES[name], c, cache, a.threads, a.steps)
                row.append((what, p["predicted"]["seconds"], measured))


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
    print("command: python3 bench/time_model.py " + " ".join(sys.argv[1:]))
    print(f"{os.cpu_count()} cores, {a.threads} threads, {a.rounds} rounds\n")
    rows = {}
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(a.rounds):
            run_round(a, cache, rows)
    print("| shape | precision | budget (share of plain) | plan (each round) | predicted s | measured s | error (each round) |")
    print("|---|---|---|---|---:|---:|---:|")
    worst = {}
    for (name, precision, share), runs in rows.items():
        head = f"| {name} | {precision} | {share}% |"
        runs = [r for r in runs if r is not None]
        if not runs:
            print(f"{head} does not fit | | | |")
            continue
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
