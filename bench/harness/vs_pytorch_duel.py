#!/usr/bin/env python3
"""memfit's plan against the fastest PyTorch grid point that fits, head to head (issue 16).

bench/harness/vs_pytorch.sh --duel R runs the PyTorch grid once (accumulation x checkpoint_sequential
segments x precision, each point one process), then this script. One pass over the grid is not
enough to compare within a few percent on a machine whose speed drifts in bursts lasting
seconds (a whole run can sit inside one), so for each budget (shares of PyTorch eager's peak)
and each mode (fp32 only; mixed precision allowed):

  - the PyTorch candidates are the grid points that fit the budget and whose fastest step in
    the grid pass is within --near (15%) of the fastest fitting point's, at most 4 (one pass
    is noisy: a candidate too many costs little, the true fastest left out would flatter memfit);
  - memfit's side is `memfit train --budget B --precision fp32|auto`: planned by memfit itself
    (no trial runs; the profile cache, filled by `memfit plan` for every row first, holds the
    sizes each plan timed);
  - memfit's run and its candidates run in lockstep (bench/harness/lockstep.py): each process starts
    and warms up alone, then they take turns of a few steps while the others are stopped, so
    every comparison is between steps seconds apart; rows with the same memfit plan and the
    same candidates share one lockstep run;
  - the fastest candidate is the one with the least median over turns; a turn's ratio is
    memfit's median step in that turn over that candidate's; a row's
    ratio is the median over --turns turns. Goals: <= 1.02x, and <= 0.95x where the fastest
    candidate recomputes (checkpoint_sequential).

    python3 bench/harness/vs_pytorch_duel.py --jsonl GRID.jsonl --twin-args FILE --memfit-args FILE
        [--memfit build/memfit] [--threads 1] [--turns 16] [--md OUT.md]

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

from lockstep import quartiles, run_lockstep, turn_medians

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
    return [r["variant"] for r in fitting if r["min_step_s"] <= best * (1 + near)][:4]


def twin_command(a, twin_args, variant):
    return [PY, os.path.join(HERE, "pytorch_twin.py"), *twin_args, "--threads", str(a.threads), "--stream",
            "--steps", "1000000", "--variant", variant]


def memfit_command(a, memfit_args, budget, precision, cache):
    return [a.memfit, "train", *memfit_args, "--budget", str(budget), "--precision", precision,
            "--threads", str(a.threads), "--steps", "1000000", "--progress-every", "1", "--profile-cache", cache,
            "--eval-every", "0", "--report", ""]


def plan_line(config):
    """How `memfit train` prints the plan it runs (its first plan line)."""
    return f"micro-batch {config['micro_batch']} x {config['accumulation']} accumulation steps, precision {config['precision']}"


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
    ap.add_argument("--turns", type=int, default=16, help="lockstep turns per duel")
    ap.add_argument("--steps-per-turn", type=int, default=4, help="step lines per turn (the first and the next "
                    "one are left out: paused, then cold)")
    ap.add_argument("--near", type=float, default=0.15)
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
            if r["candidates"]:
                r["duel"] = duels.setdefault(key, {"row": r, "memfit": [], "twin": {}})
        for i, d in enumerate(duels.values()):
            r = d["row"]
            print(f"== duel {i + 1}/{len(duels)}: memfit {r['share']}% {r['precision']} ({describe(r['config'])}) "
                  f"against PyTorch {', '.join(r['candidates'])}, {a.turns} turns", file=sys.stderr)
            commands = [memfit_command(a, memfit_args, r["budget"], r["precision"], cache)]
            commands += [twin_command(a, twin_args, v) for v in r["candidates"]]
            samples, lines = run_lockstep(commands, a.turns, a.steps_per_turn)
            if not any(plan_line(r["config"]) in l for l in lines[0]):
                sys.exit(f"vs_pytorch_duel: memfit train did not run the plan memfit plan made ({describe(r['config'])}):\n"
                         + "\n".join(lines[0][:12]))
            medians = turn_medians(samples)
            d["memfit"] = medians[0]
            d["twin"] = dict(zip(r["candidates"], medians[1:]))
    print_table(a, eager, rows)


def print_table(a, eager, rows):
    lines = [f"command: {a.command}" if a.command else "",
             f"memfit's run and its PyTorch candidates in lockstep (bench/harness/lockstep.py), {a.turns} turns of "
             f"{a.steps_per_turn} step lines each ({a.steps_per_turn - 2} timed); times are medians over turns of each "
             f"process's median step in the turn, the ratio the median over turns of memfit's time over the fastest "
             f"candidate's in that turn (quartiles in brackets); PyTorch eager's peak {eager['peak_bytes']} B; "
             f"{a.threads} threads",
             "",
             "| budget | mode | fastest fitting PyTorch point (other candidates) | PyTorch s | memfit plan | memfit s | ratio (quartiles over turns) | goal |",
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
        per_turn = [m / t for m, t in zip(d["memfit"], d["twin"][best])]
        ratio = statistics.median(per_turn)
        goal = 0.95 if "ckpt_seq" in best else 1.02
        low, high = quartiles(per_turn)
        each = f"{low:.3f}-{high:.3f}"
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
