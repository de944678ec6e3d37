#!/usr/bin/env bash
# ZeRO 3 at prefetch depths 0, 1, 2 against ZeRO 2 on N local ranks (c10d/Gloo over loopback):
# the same model, batch, schedule (every block recomputed, as stage 3 must), micro-batch and
# budget, in alternating rounds. Per variant: the median step time (rank 0's log, the first 2
# steps left out) over rounds, its ratio to ZeRO 2's, every rank's measured peak against the
# plan's prediction, and the weights' hash in each round (equal across variants and rounds: the
# same sums; a line after the table names any round that differs).
#   bench/harness/zero3_step_time.sh build/memfit [RANKS] [ROUNDS] [model flags...]
#   ZERO3_VARIANTS="2: 3:1 3:2"   a subset of the variants (default: ZeRO 2, ZeRO 3 at depths 0-2)
# Default model: the GPT of bench/RESULTS.md's ZeRO 3 section, micro-batch 2 (2 per rank's step
# at 2 ranks).
set -eu
memfit_arg=$1
memfit=$(realpath "$1")
ranks=${2:-2}
rounds=${3:-3}
shift $(( $# >= 3 ? 3 : $# ))
model=("$@")
[ ${#model[@]} -eq 0 ] && model=(--layers 4 --d-model 256 --heads 4 --seq 64 --batch 8 --dropout 0 --micro-batch 2)
here=$(cd "$(dirname "$0")" && pwd)
source "$here/quiet_env.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=("${model[@]}" --no-progress --eval-every 0 --report "" --checkpoint all --precision fp32 --budget 512MiB --steps 12)
# ZERO3_VARIANTS: which to run, "STAGE:DEPTH" each, ZeRO 2 first (the ratios' base).
read -r -a variants <<< "${ZERO3_VARIANTS:-2: 3:0 3:1 3:2}"
echo "command: ${ZERO3_VARIANTS:+ZERO3_VARIANTS=\"$ZERO3_VARIANTS\" }bash bench/harness/zero3_step_time.sh $memfit_arg $ranks $rounds ${model[*]}"
echo "model: ${model[*]}; $ranks ranks; $rounds round(s); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
# Thread-count settings change the bits (the CLI sets both FALSE unless they are set here).
echo "environment: MKL_DYNAMIC=${MKL_DYNAMIC:-unset} OMP_DYNAMIC=${OMP_DYNAMIC:-unset} OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}"
for ((r = 1; r <= rounds; r++)); do
  for v in "${variants[@]}"; do
    zero=${v%%:*} depth=${v#*:}
    name="z$zero${depth:+d$depth}"
    extra=(--zero "$zero")
    [ -n "$depth" ] && extra+=(--prefetch-depth "$depth")
    "$memfit" launch --nproc "$ranks" -- train "${common[@]}" "${extra[@]}" --json-log "$dir/$name.r$r.jsonl" \
      > "$dir/$name.r$r.out" 2>&1 || { echo "$name round $r failed: $(tail -3 "$dir/$name.r$r.out")"; exit 1; }
  done
done
"${PYTHON:-python3}" - "$dir" "$rounds" "${variants[@]}" <<'PY'
import json, re, statistics, sys
d, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def name(v):
    zero, depth = v.split(":")
    return f"z{zero}" + (f"d{depth}" if depth else "")
rows = {}
for v in variants:
    medians, peaks, hashes = [], {}, []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{d}/{name(v)}.r{r}.jsonl")]
        medians.append(statistics.median([l["seconds"] for l in lines if l["type"] == "step"][2:]))
        hashes.append(lines[-1]["weights_sha256"][:16])
        out = open(f"{d}/{name(v)}.r{r}.out").read()
        for rank, b in re.findall(r"\[rank (\d+)\]   peak [\d.]+ \w+ \((\d+) bytes\)", out):
            peaks[int(rank)] = int(b)
        predicted = {int(k): int(b) for k, b in re.findall(r"\[rank (\d+)\]   predicted peak +[\d.]+ \w+ +(\d+) B", out)}
    rows[v] = (statistics.median(medians), medians, peaks, predicted, hashes)
base = rows[variants[0]][0]
print("| variant | median step | / ZeRO 2 | per round | rank peaks measured / predicted | weights |")
print("|---|---:|---:|---|---|---|")
for v in variants:
    med, meds, peaks, pred, hashes = rows[v]
    zero, depth = v.split(":")
    label = f"ZeRO {zero}" + (f", depth {depth}" if depth else "")
    cells = ", ".join(f"r{k} {peaks[k]} / {pred[k]} ({peaks[k] / pred[k] - 1:+.1%})" for k in sorted(peaks))
    print(f"| {label} | {med:.3f} s | {med / base:.3f}x | {' '.join(f'{m:.3f}' for m in meds)} | {cells} | {' '.join(dict.fromkeys(hashes))} |")
# Stage 2 sums a rank's micro-batches before the ranks, stage 3 each micro-batch over the ranks
# first: with several micro-batches a rank, the stages' bits differ by design; depths must not.
for stage in dict.fromkeys(v.split(":")[0] for v in variants):
    mine = [v for v in variants if v.split(":")[0] == stage]
    every = [h for v in mine for h in rows[v][4]]
    common = max(set(every), key=every.count)
    odd = [f"{v} round {r + 1}: {h}" for v in mine for r, h in enumerate(rows[v][4]) if h != common]
    print(f"weights, ZeRO {stage}: {common} in every round" + (" except " + "; ".join(odd) if odd else ""))
PY
