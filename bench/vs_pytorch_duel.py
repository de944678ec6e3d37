#!/usr/bin/env python3
"""memfit's plan against the fastest PyTorch grid point that fits, head to head (issue 16).

bench/vs_pytorch.sh --duel R runs the PyTorch grid once (accumulation x checkpoint_sequential
segments x precision, each point one process), then this script. One pass over the grid is not
enough to compare within a few percent on a machine whose speed drifts in bursts lasting
seconds (a whole run can sit inside one), so for each budget (shares of PyTorch eager's peak)
and each mode (fp32 only; mixed precision allowed):

  - the PyTorch candidates are the grid points that fit the budget and whose fastest step in
    the grid pass is within --near (10%) of the fastest fitting point's, at most 3;
  - memfit's side is `memfit train --budget B --precision fp32|auto`: planned by memfit itself
    (no trial runs; the profile cache makes later rounds plan from the first round's profile);
  - each round runs memfit's run and then its candidates' runs back to back (the speed drifts
    by ~10% within a minute here, so only runs seconds apart compare); rows with the same
    memfit plan (`memfit plan` from the same profile cache says which) and the same candidates
    share their runs; each run's time is the median of its timed steps (PyTorch: after its
    warm-up steps; memfit: steps 3 and later);
  - a round's ratio is memfit's time over its fastest candidate's in that round; a row's ratio
    is the median over R rounds. Goals: <= 1.02x, and <= 0.95x where the fastest candidate
    recomputes (checkpoint_sequential).

    python3 bench/vs_pytorch_duel.py --jsonl GRID.jsonl --twin-args FILE --memfit-args FILE
        [--memfit build/memfit] [--threads 1] [--rounds 3] [--md OUT.md]

--twin-args / --memfit-args: files with one argument per line, naming the model on each side
(vs_pytorch.sh writes them). Prints a markdown table and, with --md, writes it there too.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SHARES = (90, 70, 50, 35)
PY = "/usr/bin/python3"  # Debian's interpreter: the one that sees python3-torch


def read_args(path):
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.rstrip("\n")]


def grid_rows(path):
    """The PyTorch grid pass: rows that ran (not the base comparison's, not memfit's)."""
    rows = [json.loads(l) for l in open(path) if l.startswith("{")]
    return [r for r in rows if r.get("side") != "memfit" and not r.get("base") and "error" not in r]


def is_mixed(variant):
    return "autocast_bf16" in variant


def candidates(grid, budget, mixed, near):
    fitting = [r for r in grid if r["peak_bytes"] <= budget and (mixed or not is_mixed(r["variant"]))]
    if not fitting:
        return []
    fitting.sort(key=lambda r: r["min_step_s"])
    best = fitting[0]["min_step_s"]
    return [r["variant"] for r in fitting if r["min_step_s"] <= best * (1 + near)][:3]


def run_twin(a, twin_args, variant):
    cmd = [PY, os.path.join(HERE, "pytorch_twin.py"), *twin_args, "--threads", str(a.threads),
           "--steps", str(a.steps), "--json", "--variant", variant]
    out = subprocess.run(cmd, capture_output=True, text=True)
    line = next((l for l in out.stdout.splitlines() if l.startswith("{")), None)
    if out.returncode != 0 or line is None or "error" in json.loads(line):
        sys.exit(f"vs_pytorch_duel: {' '.join(cmd)} failed: {out.stderr.strip() or line}")
    return json.loads(line)["median_step_s"]


def run_memfit(a, memfit_args, budget, precision, cache):
    """One `memfit train` under the budget: its plan and the median of its steps 3 and later."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as log:
        cmd = [a.memfit, "train", *memfit_args, "--budget", str(budget), "--precision", precision,
               "--threads", str(a.threads), "--steps", str(a.steps + 2), "--profile-cache", cache,
               "--eval-every", "0", "--report", "", "--no-progress", "--json-log", log.name]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"vs_pytorch_duel: {' '.join(cmd)} failed: {out.stderr.strip()}")
        lines = [json.loads(l) for l in open(log.name) if l.strip()]
    steps = [l["seconds"] for l in lines if l.get("type") == "step"]
    plan = next(l for l in lines if l.get("type") == "plan")
    return statistics.median(steps[2:]), plan


def describe(plan):
    c = plan.get("config", plan)
    blocks = c.get("recomputed_blocks", [])
    return f"{c['micro_batch']}x{c['accumulation']} {c['precision']}" + (f", recompute {len(blocks)}" if blocks else "")


def plan_config(a, memfit_args, budget, precision, cache):
    """What `memfit train` will run at this budget: `memfit plan` from the same profile cache."""
    cmd = [a.memfit, "plan", *memfit_args, "--budget", str(budget), "--precision", precision, "--json",
           "--no-verify", "--threads", str(a.threads), "--profile-cache", cache]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        sys.exit(f"vs_pytorch_duel: {' '.join(cmd)} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)["config"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--twin-args", required=True)
    ap.add_argument("--memfit-args", required=True)
    ap.add_argument("--memfit", default="build/memfit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--near", type=float, default=0.10)
    ap.add_argument("--command", default="")
    ap.add_argument("--md")
    a = ap.parse_args()
    twin_args, memfit_args = read_args(a.twin_args), read_args(a.memfit_args)
    grid = grid_rows(a.jsonl)
    eager = next(r for r in grid if r["variant"] == "eager")
    with tempfile.TemporaryDirectory() as cache:
        rows = []
        for share in SHARES:
            budget = eager["peak_bytes"] * share // 100
            for mixed in (False, True):
                precision = "auto" if mixed else "fp32"
                rows.append({"share": share, "budget": budget, "mixed": mixed, "precision": precision,
                             "candidates": candidates(grid, budget, mixed, a.near),
                             "config": plan_config(a, memfit_args, budget, precision, cache)})
        # Planned again once every budget's plan has timed what it runs (the cache now holds
        # those points, and a later budget's may change an earlier one's choice).
        for r in rows:
            r["config"] = plan_config(a, memfit_args, r["budget"], r["precision"], cache)
        # Rows with the same memfit plan and the same PyTorch candidates are one duel.
        duels = {}
        for r in rows:
            key = json.dumps([r["config"], r["candidates"]], sort_keys=True)
            r["duel"] = duels.setdefault(key, {"row": r, "memfit": [], "twin": {v: [] for v in r["candidates"]}})
        for rnd in range(a.rounds):
            for d in duels.values():
                r = d["row"]
                print(f"== round {rnd + 1}/{a.rounds}: memfit {r['share']}% {r['precision']}, then PyTorch "
                      f"{', '.join(r['candidates'])}", file=sys.stderr)
                seconds, plan = run_memfit(a, memfit_args, r["budget"], r["precision"], cache)
                if plan["config"] != r["config"]:
                    sys.exit(f"vs_pytorch_duel: memfit train ran {describe(plan)}, memfit plan said {describe(r['config'])}")
                d["memfit"].append(seconds)
                for v in r["candidates"]:
                    d["twin"][v].append(run_twin(a, twin_args, v))
    print_table(a, eager, rows)


def print_table(a, eager, rows):
    lines = [f"command: {a.command}" if a.command else "",
             f"{a.rounds} rounds; in each, memfit's run and then its PyTorch candidates' runs, back to back; "
             f"times are medians over rounds of each run's median step, the ratio the median over rounds of "
             f"memfit's time over the fastest candidate's in that round; PyTorch eager's peak "
             f"{eager['peak_bytes']} B; {a.threads} threads",
             "",
             "| budget | mode | fastest fitting PyTorch point (other candidates) | PyTorch s | memfit plan | memfit s | ratio (each round) | goal |",
             "|---|---|---|---:|---|---:|---:|---|"]
    for r in rows:
        mode = "mixed allowed" if r["mixed"] else "fp32"
        if not r["candidates"]:
            lines.append(f"| {r['share']}% | {mode} | none fits | | {describe(r['config'])} | | | |")
            continue
        d = r["duel"]
        medians = {v: statistics.median(t) for v, t in d["twin"].items()}
        best = min(medians, key=medians.get)
        others = ", ".join(f"{v} {medians[v]:.3f}" for v in medians if v != best)
        per_round = [m / min(t[i] for t in d["twin"].values()) for i, m in enumerate(d["memfit"])]
        ratio = statistics.median(per_round)
        goal = 0.95 if "ckpt_seq" in best else 1.02
        each = ", ".join(f"{x:.3f}" for x in per_round)
        lines.append(f"| {r['share']}% | {mode} | {best}" + (f" ({others})" if others else "") +
                     f" | {medians[best]:.3f} | {describe(r['config'])} | {statistics.median(d['memfit']):.3f} | "
                     f"{ratio:.3f}x ({each}) | {'met' if ratio <= goal else 'not met'} (<= {goal}) |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.md:
        tmp = a.md + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, a.md)


if __name__ == "__main__":
    main()
