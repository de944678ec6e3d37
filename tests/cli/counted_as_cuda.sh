#!/usr/bin/env bash
# The CLI in the counted-as-CUDA mode (MEMFIT_COUNT_CPU_AS=cuda: memfit's CPU allocator reports
# its bytes as cuda:0's, memory_tracker.h) gives the byte numbers of the CPU mode: report,
# plan and train each read the step's device, never the CPU's by default.
set -euo pipefail
memfit=$1
source "$(dirname "$0")/lib.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
gpt=(--layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 --threads 1)

for mode in cpu cuda; do
  env_mode=(); [ "$mode" = cuda ] && env_mode=(MEMFIT_COUNT_CPU_AS=cuda)
  env "${env_mode[@]}" "$memfit" report "${gpt[@]}" --steps 2 --checkpoint every:2 --micro-batch 4 --json > "$dir/report-$mode.json"
  # A pinned configuration: the numbers are bytes only, whatever the timings.
  env "${env_mode[@]}" "$memfit" plan "${gpt[@]}" --budget 64MiB --micro-batch 4 --checkpoint all --precision fp32 --optimizer-state fp32 \
    --json > "$dir/plan-$mode.json"
  env "${env_mode[@]}" "$memfit" train "${gpt[@]}" --steps 3 --budget 64MiB --micro-batch 4 --checkpoint all \
    --precision fp32 --optimizer-state fp32 --eval-every 0 --no-progress --report "" --json-log "$dir/train-$mode.jsonl" > /dev/null
done

py "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def load(name): return json.load(open(f"{d}/{name}"))
def steps(mode): return [j for j in map(json.loads, open(f"{d}/train-{mode}.jsonl")) if j.get("type") == "step"]
failed = 0
def same(what, a, b):
    global failed
    if a != b:
        failed += 1
        print(f"FAILED: {what}: cpu {a} vs counted as cuda {b}")
r = {m: load(f"report-{m}.json") for m in ("cpu", "cuda")}
for key in ("peak_bytes", "at_peak", "states", "between_steps_bytes", "phases", "blocks", "cuda_reserved_peak_bytes"):
    same("report " + key, r["cpu"][key], r["cuda"][key])
p = {m: load(f"plan-{m}.json") for m in ("cpu", "cuda")}
for key in ("feasible", "floor_bytes"):
    same("plan " + key, p["cpu"][key], p["cuda"][key])
same("plan predicted peak", p["cpu"]["predicted"]["peak_bytes"], p["cuda"]["predicted"]["peak_bytes"])
same("plan measured peak", p["cpu"]["measured"]["peak_bytes"], p["cuda"]["measured"]["peak_bytes"])
assert p["cpu"]["measured"]["peak_bytes"] > 0
t = {m: steps(m) for m in ("cpu", "cuda")}
assert len(t["cpu"]) == 3, t["cpu"]
for key in ("peak_bytes", "live_bytes"):
    same("train " + key, [s[key] for s in t["cpu"]], [s[key] for s in t["cuda"]])
print(f"cli counted as cuda: {1 if failed == 0 else 0} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
