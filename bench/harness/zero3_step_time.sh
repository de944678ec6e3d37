#!/usr/bin/env bash
# ZeRO 3 vs ZeRO 2 on 2 local ranks (c10d/Gloo over loopback): the median step time (rank 0's
# log, the first 2 steps left out) and each rank's peak, the same model, batch, schedule
# (every block recomputed, as stage 3 must) and budget for both, in alternating rounds.
#   bench/harness/zero3_step_time.sh build/memfit [ROUNDS] [model flags...]
# Default model: the GPT of bench/RESULTS.md's ZeRO 3 section.
set -eu
memfit=$(realpath "$1")
rounds=${2:-1}
shift $(( $# >= 2 ? 2 : $# ))
model=("$@")
[ ${#model[@]} -eq 0 ] && model=(--layers 4 --d-model 256 --heads 4 --seq 64 --batch 8 --dropout 0)
here=$(cd "$(dirname "$0")" && pwd)
source "$here/quiet_env.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=("${model[@]}" --no-progress --eval-every 0 --report "" --checkpoint all --precision fp32 --micro-batch 4
        --budget 512MiB --steps 12)
echo "model: ${model[*]}; $rounds round(s); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= rounds; r++)); do
  for z in 2 3; do
    "$memfit" launch --nproc 2 -- train "${common[@]}" --zero $z --json-log "$dir/z$z.jsonl" > "$dir/z$z.out" 2>&1
    /usr/bin/python3 - "$dir/z$z.jsonl" "$dir/z$z.out" "$z" "$r" <<'PY'
import json, re, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [l["seconds"] for l in lines if l["type"] == "step"][2:]
peaks = re.findall(r"\[rank (\d)\]   peak [\d.]+ \w+ \((\d+) bytes\)", open(sys.argv[2]).read())
summary = lines[-1]
state = summary["ranks"][0]
print(f"round {sys.argv[4]} zero {sys.argv[3]}: median step {statistics.median(steps):.3f} s over {len(steps)} steps; "
      f"peaks {', '.join(f'rank {r} {int(b) / 2**20:.1f} MiB' for r, b in sorted(peaks))}; rank 0 state: weights "
      f"{state['weights'] / 2**20:.2f} MiB, gradients {state['gradients'] / 2**20:.2f} MiB, "
      f"optimizer {state['optimizer_state'] / 2**20:.2f} MiB")
PY
  done
done
