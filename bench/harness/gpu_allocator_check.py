#!/usr/bin/env python3
"""The CUDA caching allocator on a GPU (issue 32), run by bench/gpu_check.sh: for each
configuration (the built-in GPT and CNN, a TorchScript GPT; fp32 and bf16)

1. the plain step, `memfit report --device cuda`: the peaks the allocator model predicts from
   the step's own allocations (cuda_reserved_peak_bytes, cuda_allocated_peak_bytes) against the
   allocator's counters (max_memory_reserved, max_memory_allocated);
2. the plan at two budgets (the memory outside the allocator + 90% and 60% of the plain step's
   max_memory_reserved), `memfit plan --device cuda --verify-steps 20`: 20 steps under the
   memory fraction, the predicted peaks against the measured ones, allocator retries and
   out-of-memory errors.

Prints one markdown table (with the card's name) for bench/RESULTS.md, then a last line
"allocator check: N rows, M passed"; exits 1 if any row fails. A row passes when the predicted
reserved peak is within 2% or 20 MiB of max_memory_reserved and, for plans, no retry or
out-of-memory error happened. Standard library only.

    python3 bench/harness/gpu_allocator_check.py MEMFIT WORK_DIR [--python PYTHON] [--deadline UNIX_SECONDS]
"""
import argparse
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20


def run_json(cmd, deadline):
    left = max(1, int(deadline - time.time()))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)


def close(predicted, measured):
    return abs(predicted - measured) <= max(0.02 * measured, 20 * MiB)


def mib(b):
    return f"{b / MiB:.1f}"


def delta(predicted, measured):
    return f"{100.0 * (predicted - measured) / max(1, measured):+.1f}%"


def text_file(work):
    """Any text will do for the character-level GPT: the repository's own documents."""
    path = os.path.join(work, "text.txt")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    with open(path, "w") as out:
        for name in ("README.md", "ARCHITECTURE.md", "bench/RESULTS.md"):
            with open(os.path.join(root, name), errors="replace") as f:
                out.write(f.read())
    return path


def configurations(work, python):
    text = text_file(work)
    subprocess.run([python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "user_models.py"), work],
                   check=True, capture_output=True)
    gpt = ["--model", "gpt", "--data", text, "--layers", "8", "--d-model", "512", "--heads", "8", "--seq", "256",
           "--batch", "32"]
    cnn = ["--model", "cnn", "--blocks", "6", "--channels", "64", "--batch", "256"]
    script = ["--model", os.path.join(work, "gpt.pt"), "--data", os.path.join(work, "gpt_data.pt"), "--batch", "64"]
    return [("GPT 8x512", p, gpt) for p in ("fp32", "bf16")] + [("CNN 6x64", p, cnn) for p in ("fp32", "bf16")] + \
           [("TorchScript GPT 6x256", p, script) for p in ("fp32", "bf16")]


def plain_row(memfit, name, precision, args, deadline):
    j = run_json([memfit, "report", *args, "--device", "cuda", "--precision", precision, "--steps", "3", "--json"],
                 deadline)
    m = j["device_memory"]["cuda"]
    row = {"config": f"{name} {precision}", "what": "plain step", "budget": "-",
           "pred_reserved": j["cuda_reserved_peak_bytes"], "reserved": m["peak_reserved_bytes"],
           "pred_allocated": j["cuda_allocated_peak_bytes"], "allocated": m["peak_allocated_bytes"],
           "retries": m["num_alloc_retries"], "ooms": m["num_ooms"]}
    row["pass"] = close(row["pred_reserved"], row["reserved"])
    return row, j.get("cuda_outside_bytes", {})


def plan_row(memfit, name, precision, args, budget, deadline):
    j = run_json([memfit, "plan", *args, "--device", "cuda", "--precision", precision, "--budget", str(budget),
                  "--json", "--verify-steps", "20"], deadline)
    row = {"config": f"{name} {precision}", "budget": mib(budget)}
    if not j.get("feasible") or "measured" not in j:
        row.update(what="no plan", **{"pass": False})
        return row
    c, cfg = j["measured"]["cuda"], j["config"]
    row.update(what=f"plan {cfg['micro_batch']} x {cfg['accumulation']}, {len(cfg['recomputed_blocks'])} recomputed",
               pred_reserved=j["cuda_reserved_peak_bytes"], reserved=c["max_memory_reserved"],
               pred_allocated=j["cuda_allocated_peak_bytes"], allocated=c["max_memory_allocated"],
               retries=c["num_alloc_retries"], ooms=c["num_ooms"])
    row["pass"] = close(row["pred_reserved"], row["reserved"]) and row["retries"] == 0 and row["ooms"] == 0
    return row


def table(rows, card, rules):
    lines = [f"CUDA caching allocator, predicted vs measured on {card} (LibTorch {rules} rules; MiB; "
             "pass: reserved within 2% or 20 MiB, plans with 0 retries and 0 out-of-memory errors over 20 steps)", "",
             "| configuration | run | budget | reserved pred | max_memory_reserved | Δ | allocated pred | "
             "max_memory_allocated | Δ | retries | OOMs | pass |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "reserved" not in r:
            lines.append(f"| {r['config']} | {r['what']} | {r['budget']} | | | | | | | | | FAIL |")
            continue
        lines.append(f"| {r['config']} | {r['what']} | {r['budget']} | {mib(r['pred_reserved'])} | {mib(r['reserved'])} | "
                     f"{delta(r['pred_reserved'], r['reserved'])} | {mib(r['pred_allocated'])} | {mib(r['allocated'])} | "
                     f"{delta(r['pred_allocated'], r['allocated'])} | {r['retries']} | {r['ooms']} | "
                     f"{'yes' if r['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("memfit")
    ap.add_argument("work")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--deadline", type=float, default=time.time() + 420)
    ap.add_argument("--card", default="?")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    rows, rules = [], "?"
    for name, precision, args in configurations(a.work, a.python):
        try:
            plain, outside = plain_row(a.memfit, name, precision, args, a.deadline)
            rows.append(plain)
            outside_total = outside.get("context_and_others", 0) + outside.get("cublas", 0)
            for share in (0.9, 0.6):
                budget = outside_total + int(share * plain["reserved"])
                rows.append(plan_row(a.memfit, name, precision, args, budget, a.deadline))
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, json.JSONDecodeError) as e:
            print(f"allocator check: {name} {precision}: {e}", file=sys.stderr)
            rows.append({"config": f"{name} {precision}", "what": "error", "budget": "-", "pass": False})
    version = subprocess.run([a.memfit, "--version"], capture_output=True, text=True).stdout
    rules = "1.13" if "LibTorch 1.13" in version else "2.x"
    print(table(rows, a.card, rules))
    passed = sum(1 for r in rows if r["pass"])
    print(f"allocator check: {len(rows)} rows, {passed} passed")
    return 0 if passed == len(rows) and len(rows) >= 15 else 1


if __name__ == "__main__":
    sys.exit(main())
