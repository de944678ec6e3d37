#!/usr/bin/env python3
"""memfit on a GPU against the CUDA caching allocator itself, run by bench/gpu_check.sh. For each
configuration (the built-in GPT in fp32 and bf16, the CNN, a TorchScript GPT in bf16):

1. the plain step, `memfit report --device cuda`: the reserved and allocated peaks the allocator
   model predicts from the step's own allocations against max_memory_reserved and
   max_memory_allocated;
2. `memfit train --device cuda` for 20 steps at budgets of the memory outside the allocator plus
   90%, 60% and 45% of the plain step's max_memory_reserved: the plan's checked reserved peak
   (its steps replayed on the allocator model under the cap) against max_memory_reserved over
   the 20 steps, and the allocator's retries and out-of-memory errors there;
3. the GPT in fp32 with the optimizer offloaded to the host (`--offload optimizer`) at 45%.

Then bench/harness/gpu_python_check.py (the Python package: memfit.fit on a Hugging Face-style
GPT-2 at 60% and 45%) adds its rows when --python-package names an interpreter that imports
memfit. Prints one markdown table with the card's name, then "gpu check: N rows, M passed";
exits 1 if any row fails. A plain row passes when the predicted reserved peak is within 2% or
20 MiB of max_memory_reserved; a training row when it also had 0 retries, 0 out-of-memory
errors and 0 recoveries, and its reserved peak stayed under the cap. Standard library only.

    python3 bench/harness/gpu_allocator_check.py MEMFIT WORK_DIR [--python PYTHON] [--deadline UNIX_SECONDS]
        [--card NAME] [--python-package PYTHON] [--rehearse]

--rehearse runs every row on the CPU with tiny shapes and 3 steps: it checks the rows' commands
and fields before a GPU's time is spent on them (the CUDA columns stay empty; a row passes when
its steps held the budget).
"""
import argparse
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, deadline):
    left = max(1, int(deadline - time.time()))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()[-400:]}")
    return out.stdout


def close(predicted, measured):
    return abs(predicted - measured) <= max(0.02 * measured, 20 * MiB)


def mib(b):
    return f"{b / MiB:.1f}" if isinstance(b, int) else "-"


def delta(predicted, measured):
    if not isinstance(predicted, int) or not isinstance(measured, int):
        return ""
    return f"{100.0 * (predicted - measured) / max(1, measured):+.1f}%"


def text_file(work):
    """Any text will do for the character-level GPT: the repository's own documents."""
    path = os.path.join(work, "text.txt")
    root = os.path.join(HERE, "..", "..")
    with open(path, "w") as out:
        for name in ("README.md", "ARCHITECTURE.md", "bench/RESULTS.md", "docs/cli.md", "docs/python.md"):
            if os.path.exists(os.path.join(root, name)):
                with open(os.path.join(root, name), errors="replace") as f:
                    out.write(f.read())
    return path


def configurations(work, python, rehearse):
    text = text_file(work)
    subprocess.run([python, os.path.join(HERE, "user_models.py"), work], check=True, capture_output=True)
    if rehearse:
        gpt = ["--model", "gpt", "--data", text, "--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "32",
               "--batch", "8", "--threads", "1"]
        cnn = ["--model", "cnn", "--blocks", "2", "--channels", "8", "--batch", "16", "--threads", "1"]
        script = ["--model", os.path.join(work, "gpt.pt"), "--data", os.path.join(work, "gpt_data.pt"), "--batch", "8",
                  "--threads", "1"]
    else:
        gpt = ["--model", "gpt", "--data", text, "--layers", "8", "--d-model", "512", "--heads", "8", "--seq", "256",
               "--batch", "32"]
        cnn = ["--model", "cnn", "--blocks", "6", "--channels", "64", "--batch", "256"]
        script = ["--model", os.path.join(work, "gpt.pt"), "--data", os.path.join(work, "gpt_data.pt"), "--batch", "64"]
    return [("GPT 8x512", "fp32", gpt), ("GPT 8x512", "bf16", gpt), ("CNN 6x64", "fp32", cnn),
            ("TorchScript GPT 6x256", "bf16", script)]


def plain_row(memfit, device, name, precision, args, deadline):
    j = json.loads(run([memfit, "report", *args, "--device", device, "--precision", precision, "--steps", "3",
                        "--json"], deadline))
    row = {"config": f"{name} {precision}", "what": "plain step", "budget": "-",
           "pred_reserved": j["cuda_reserved_peak_bytes"], "pred_allocated": j["cuda_allocated_peak_bytes"]}
    m = j["device_memory"].get("cuda")
    if m is None:  # rehearsal: the tracker's peak stands for the allocator's
        row.update(reserved=j["peak_bytes"], allocated=j["peak_bytes"], retries=0, ooms=0, **{"pass": True})
        return row, 0
    row.update(reserved=m["peak_reserved_bytes"], allocated=m["peak_allocated_bytes"], retries=m["num_alloc_retries"],
               ooms=m["num_ooms"])
    row["pass"] = close(row["pred_reserved"], row["reserved"])
    outside = j.get("cuda_outside_bytes", {})
    return row, outside.get("context_and_others", 0) + outside.get("cublas", 0)


def train_row(memfit, device, name, precision, args, budget, steps, work, deadline, offload=None):
    log = os.path.join(work, "train.jsonl")
    cmd = [memfit, "train", *args, "--device", device, "--precision", precision, "--budget", str(budget),
           "--steps", str(steps), "--eval-every", "0", "--no-progress", "--report", "", "--json-log", log]
    if offload:
        cmd += ["--offload", offload]
    run(cmd, deadline)
    with open(log) as f:
        summary = [json.loads(line) for line in f][-1]
    plan, cfg = summary["plan"], summary["plan"]["config"]
    what = f"train {steps}: {cfg['micro_batch']} x {cfg['accumulation']}, {len(cfg['recomputed_blocks'])} recomputed"
    if offload:
        what += f", {offload} offloaded"
    row = {"config": f"{name} {precision}", "what": what, "budget": mib(budget), "recoveries": summary["oom_recoveries"]}
    c = summary.get("cuda")
    if c is None:  # rehearsal
        row.update(reserved=summary["peak_bytes"], allocated=summary["peak_bytes"], retries=0, ooms=0,
                   pred_allocated=plan["predicted"]["peak_bytes"])
        row["pass"] = summary["peak_bytes"] <= budget and row["recoveries"] == 0
        return row
    checked = plan.get("reserved", {})
    row.update(pred_reserved=checked.get("peak_reserved_bytes"), reserved=c["max_memory_reserved"],
               pred_allocated=plan["predicted"]["peak_bytes"], allocated=c["max_memory_allocated"],
               retries=c["num_alloc_retries"], ooms=c["num_ooms"])
    cap = budget - c["outside_bytes"]
    row["pass"] = (row["retries"] == 0 and row["ooms"] == 0 and row["recoveries"] == 0 and c["max_memory_reserved"] <= cap
                   and isinstance(row["pred_reserved"], int) and close(row["pred_reserved"], row["reserved"]))
    return row


def table(rows, card, rules):
    lines = [f"memfit on {card} against the CUDA caching allocator (LibTorch {rules} rules; MiB; a plain row passes "
             "when reserved is predicted within 2% or 20 MiB; a training row also needs 0 retries, 0 out-of-memory "
             "errors, 0 recoveries and its reserved peak under the cap)", "",
             "| configuration | run | budget | reserved pred | max_memory_reserved | Δ | allocated pred | "
             "max_memory_allocated | Δ | retries | OOMs | pass |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "reserved" not in r:
            lines.append(f"| {r['config']} | {r['what']} | {r['budget']} | | | | | | | | | FAIL |")
            continue
        lines.append(f"| {r['config']} | {r['what']} | {r['budget']} | {mib(r.get('pred_reserved'))} | "
                     f"{mib(r['reserved'])} | {delta(r.get('pred_reserved'), r['reserved'])} | "
                     f"{mib(r.get('pred_allocated'))} | {mib(r['allocated'])} | "
                     f"{delta(r.get('pred_allocated'), r['allocated'])} | {r['retries']} | {r['ooms']} | "
                     f"{'yes' if r['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def error_row(config, what, e):
    print(f"gpu check: {config} {what}: {e}", file=sys.stderr)
    return {"config": config, "what": f"{what}: error", "budget": "-", "pass": False}


def memfit_rows(a, device, steps):
    rows = []
    for name, precision, args in configurations(a.work, a.python, a.rehearse):
        try:
            plain, outside = plain_row(a.memfit, device, name, precision, args, a.deadline)
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, json.JSONDecodeError) as e:
            rows.append(error_row(f"{name} {precision}", "plain step", e))
            continue
        rows.append(plain)
        # (a rehearsal's tiny models have floors near their plain peaks: higher shares there)
        shares = (0.95, 0.85, 0.75) if a.rehearse else (0.9, 0.6, 0.45)
        runs = [(share, None) for share in shares]
        if name.startswith("GPT") and precision == "fp32":
            runs.append((shares[-1], "optimizer"))
        for share, offload in runs:
            budget = outside + int(share * plain["reserved"])
            try:
                rows.append(train_row(a.memfit, device, name, precision, args, budget, steps, a.work, a.deadline, offload))
            except (RuntimeError, subprocess.TimeoutExpired, KeyError, json.JSONDecodeError) as e:
                rows.append(error_row(f"{name} {precision}", f"train at {int(100 * share)}%", e))
    return rows


def python_rows(a, device, steps):
    if not a.python_package:
        return []
    cmd = [a.python_package, os.path.join(HERE, "gpu_python_check.py"), "--device", device, "--steps", str(steps)]
    try:
        return json.loads(run(cmd, a.deadline))
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        return [error_row("Python GPT-2 (HF-style)", "memfit.fit", e)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("memfit")
    ap.add_argument("work")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--python-package", default="", help="an interpreter that imports memfit (its wheel installed)")
    ap.add_argument("--deadline", type=float, default=time.time() + 420)
    ap.add_argument("--card", default="?")
    ap.add_argument("--rehearse", action="store_true", help="every row on the CPU, tiny shapes, 3 steps")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    device, steps = ("cpu", 3) if a.rehearse else ("cuda", 20)
    rows = memfit_rows(a, device, steps) + python_rows(a, device, steps)
    version = subprocess.run([a.memfit, "--version"], capture_output=True, text=True).stdout
    rules = "1.13" if "LibTorch 1.13" in version else "2.x"
    print(table(rows, "the CPU (a rehearsal)" if a.rehearse else a.card, rules))
    passed = sum(1 for r in rows if r["pass"])
    print(f"gpu check: {len(rows)} rows, {passed} passed")
    return 0 if passed == len(rows) and len(rows) >= 17 else 1


if __name__ == "__main__":
    sys.exit(main())
