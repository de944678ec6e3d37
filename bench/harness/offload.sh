#!/usr/bin/env bash
# Offload on the default GPT (fp32, and bf16 autocast for activations): device and host bytes, measured and predicted, and the step
# time against the same configuration without offload, in alternating rounds.
#   optimizer: `--offload optimizer` at 0.6x the device-only floor (weights + gradients + state +
#              the least activations);
#   auto:      `--offload auto` at the same budget (the plan may offload activations too);
#   activations: `--offload activations` at 0.5x the plain step's peak, the whole batch in one
#              micro-batch; activations-bf16: the same under bf16 autocast (its own plain peak).
# Each first runs once to plan; then its rounds pin that plan's micro-batch and recomputed blocks,
# and its twin runs them without offload (the losses must be equal bit for bit).
# On a CPU-only machine host and device share RAM: the copies are memcpys, and the plan models
# their time from a measured memcpy's bandwidth (a stand-in for a real link, said in the table).
#   bash bench/harness/offload.sh build/memfit [ROUNDS] [STEPS]
set -eu
memfit_arg=$1
memfit=$(realpath "$1")
rounds=${2:-3}
steps=${3:-8}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/quiet_env.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=(--no-progress --eval-every 0 --report "" --steps "$steps" --profile-cache "$dir/cache")
echo "command: bash bench/harness/offload.sh $memfit_arg $rounds $steps"
echo "default GPT, $steps steps a run (the first 2 left out), $rounds round(s); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
"$memfit" plan --budget 4GiB --no-verify --precision fp32 --profile-cache "$dir/cache" > "$dir/plan.out"
floor=$(sed -n 's/.*smallest budget (floor) .* \([0-9]*\) B$/\1/p' "$dir/plan.out")
plain=$(sed -n 's/.*plain step, predicted peak .* \([0-9]*\) B$/\1/p' "$dir/plan.out")
"$memfit" plan --budget 4GiB --no-verify --precision bf16 --profile-cache "$dir/cache" > "$dir/plan-bf16.out"
plain_bf16=$(sed -n 's/.*plain step, predicted peak .* \([0-9]*\) B$/\1/p' "$dir/plan-bf16.out")
# name:budget:offload:micro-batch (empty: planned):precision
variants=("optimizer:$((floor * 6 / 10)):optimizer::fp32" "auto:$((floor * 6 / 10)):auto::fp32"
          "activations:$((plain / 2)):activations:16:fp32" "activations-bf16:$((plain_bf16 / 2)):activations:16:bf16")
pinned() {  # the micro-batch and recomputed blocks of a run's plan, as flags
  /usr/bin/python3 - "$1" <<'PY'
import json, sys
s = [json.loads(l) for l in open(sys.argv[1]) if json.loads(l)["type"] == "summary"][0]["plan"]["config"]
blocks = ",".join(str(b) for b in s["recomputed_blocks"]) or "none"
print(f"--micro-batch {s['micro_batch']} --checkpoint {blocks}")
PY
}
for v in "${variants[@]}"; do
  IFS=: read -r name budget mode micro precision <<< "$v"
  "$memfit" train "${common[@]}" --precision "$precision" --budget "$budget" --offload "$mode" ${micro:+--micro-batch $micro} \
    --json-log "$dir/$name.plan.jsonl" > "$dir/$name.plan.out" 2>&1 || { echo "$name: $(tail -3 "$dir/$name.plan.out")"; exit 1; }
  pinned "$dir/$name.plan.jsonl" > "$dir/$name.flags"
done
for ((r = 1; r <= rounds; r++)); do
  for v in "${variants[@]}"; do
    IFS=: read -r name budget mode micro precision <<< "$v"
    read -r -a flags < "$dir/$name.flags"
    "$memfit" train "${common[@]}" --precision "$precision" "${flags[@]}" --budget "$budget" --offload "$mode" --json-log "$dir/$name.r$r.jsonl" \
      > "$dir/$name.r$r.out" 2>&1 || { echo "$name round $r failed: $(tail -3 "$dir/$name.r$r.out")"; exit 1; }
    "$memfit" train "${common[@]}" --precision "$precision" "${flags[@]}" --budget 4GiB --json-log "$dir/$name.twin.r$r.jsonl" \
      > "$dir/$name.twin.r$r.out" 2>&1 || { echo "$name twin round $r failed"; exit 1; }
  done
done
/usr/bin/python3 - "$dir" "$rounds" "${variants[@]}" <<'PY'
import json, statistics, sys
d, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def lines(path): return [json.loads(l) for l in open(path)]
def summary(path): return [l for l in lines(path) if l["type"] == "summary"][0]
def losses(path): return [l["loss"] for l in lines(path) if l["type"] == "step"]
def step_median(path): return statistics.median([l["seconds"] for l in lines(path) if l["type"] == "step"][2:])
pct = lambda m, q: f"{100.0 * (q - m) / m:+.2f}%"
print("| run | budget B | plan | device peak B: measured / predicted | host peak B: measured / predicted "
      "| step time / no offload, measured (memcpy) | per round | predicted (copies modelled at memcpy speed) | losses |")
print("|---|---:|---|---|---|---:|---|---:|---|")
for v in variants:
    name, budget, mode, micro, precision = v.split(":")
    s = summary(f"{d}/{name}.plan.jsonl")
    p, c = s["plan"], s["plan"]["config"]
    what = ", ".join((["optimizer"] if c["offload"]["optimizer"] else []) +
                     ([f"activations of {len(c['offload']['activation_blocks'])} blocks"] if c["offload"]["activation_blocks"] else []))
    plan = f"{c['micro_batch']} x {c['accumulation']}, recompute {len(c['recomputed_blocks'])}; offload {what}"
    dev = (s["peak_bytes"], p["predicted"]["peak_bytes"])
    host = (s["host_peak_bytes"], p["predicted"]["host_peak_bytes"])
    ratios = [step_median(f"{d}/{name}.r{r}.jsonl") / step_median(f"{d}/{name}.twin.r{r}.jsonl") for r in range(1, rounds + 1)]
    ours = statistics.median([step_median(f"{d}/{name}.r{r}.jsonl") for r in range(1, rounds + 1)])
    theirs = statistics.median([step_median(f"{d}/{name}.twin.r{r}.jsonl") for r in range(1, rounds + 1)])
    twin_plan = summary(f"{d}/{name}.twin.r1.jsonl")["plan"]
    predicted = summary(f"{d}/{name}.r1.jsonl")["plan"]["predicted"]["seconds"] / twin_plan["predicted"]["seconds"]
    same = all(losses(f"{d}/{name}.r{r}.jsonl") == losses(f"{d}/{name}.twin.r{r}.jsonl") for r in range(1, rounds + 1))
    print(f"| {name} | {budget} | {plan} | {dev[0]} / {dev[1]} ({pct(*dev)}) | {host[0]} / {host[1]} ({pct(*host)}) | "
          f"{ours / theirs:.3f} | {', '.join(f'{x:.2f}' for x in ratios)} | {predicted:.3f} | {'equal bit for bit' if same else 'DIFFER'} |")
PY
