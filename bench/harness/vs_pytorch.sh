#!/usr/bin/env bash
# memfit vs PyTorch, side by side, in one run on one machine: the PyTorch twin
# (bench/harness/pytorch_twin.py) over the grid of configurations a PyTorch user can hand-pick —
# gradient accumulation x checkpoint_sequential segments x {fp32, bf16 autocast} — then memfit
# (bench/vs_pytorch_memfit: its plain step, its plans at 100/90/70/50/35% of PyTorch eager's
# measured peak, and the micro-batching row), same threads on both sides;
# then bench/harness/vs_pytorch_table.py writes the table and the plot.
#
#   bash bench/harness/vs_pytorch.sh [--model gpt|cnn|FILE.pt] [--threads N] [--steps N] [--out DIR] [--build DIR]
#                            [--segments "2 4 8"] [--accum "1 2 4"] [--precisions "fp32 bf16"]
#                            [--data FILE --loss KIND --eager PY:FUNCTION] [-- MODEL FLAGS]
#
#   --model     gpt (default), cnn, or the user's TorchScript file (with --data, as memfit's
#               --model FILE --data FILE --loss KIND): memfit trains the file, PyTorch runs the
#               same model in Python: built as Python modules by --eager FILE.py:FUNCTION with
#               the file's weights (PyTorch eager, and checkpoint_sequential on its blocks), or
#               without --eager the TorchScript file itself from Python. No bf16 row.
#   --threads   torch, OpenMP and OpenBLAS threads on both sides (default 2)
#   --steps     timed steps per variant; times are their medians (default 5)
#   --out       where vs_pytorch_<model>.{jsonl,md,svg} go (default: bench/results/)
#   --build     memfit's build directory (default: build), holding bench/vs_pytorch_memfit
#   --segments  the grid's checkpoint_sequential segment counts besides none (default: 2, 4, 8
#               and the number of blocks after the first, those not above it)
#   --accum     the grid's gradient accumulation steps (default: 1 2 4 8 16, those dividing --batch)
#   --base-only only the base comparison: PyTorch eager and memfit's plain step alternating
#               (--base-rounds N times, default 3), then their time ratio and peaks; no grid, no plans
#   --duel T    after the grid pass, head to head instead of the one-pass table: for each
#               budget and mode, memfit's `memfit train` against the fastest fitting grid
#               points, in lockstep, T turns (bench/harness/vs_pytorch_duel.py, bench/harness/lockstep.py;
#               writes vs_pytorch_duel_<model>.md)
#   --precisions  the grid's precisions (default: fp32 bf16; a variant the model cannot run is a
#               row with its error)
#   MODEL FLAGS passed to both sides: --layers --d-model --heads --seq --dropout (gpt),
#               --blocks --channels (cnn), --batch, --seed
#
# Example (a tiny smoke run; the real comparison uses the defaults on an idle machine):
#   bash bench/harness/vs_pytorch.sh --steps 2 --out /tmp/vs -- --layers 2 --d-model 64 --heads 8 --seq 32
# The user's model (bench/harness/user_models.py exports a GPT and a BatchNorm CNN from Python):
#   /usr/bin/python3 bench/harness/user_models.py /tmp/um
#   bash bench/harness/vs_pytorch.sh --model /tmp/um/gpt.pt --data /tmp/um/gpt_data.pt --eager bench/harness/user_models.py:gpt
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
command="bash bench/harness/vs_pytorch.sh"
(($#)) && command+=$(printf ' %q' "$@")
model=gpt threads=2 steps=5 out=$root/bench/results build=$root/build segments="" data="" loss=cross-entropy eager=""
accums="" precisions="fp32 bf16" base_only=0 rounds=3 duel=0
while (($#)); do
  case $1 in
    --model) model=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --segments) segments=$2; shift 2 ;;
    --accum) accums=$2; shift 2 ;;
    --precisions) precisions=$2; shift 2 ;;
    --base-only) base_only=1; shift ;;
    --duel) duel=$2; shift 2 ;;
    --base-rounds) rounds=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --loss) loss=$2; shift 2 ;;
    --eager) eager=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "vs_pytorch: unknown flag '$1' (model flags go after --)" >&2; exit 2 ;;
  esac
done
model_flags=("$@")
script=""  # the user's TorchScript file
if [[ $model != gpt && $model != cnn ]]; then
  [[ -f $model && -n $data ]] ||
    { echo "vs_pytorch: --model must be gpt, cnn or a TorchScript file with --data, got '$model'" >&2; exit 2; }
  script=$model
fi

py=/usr/bin/python3   # Debian's interpreter: the one that sees python3-torch
"$py" -c 'import torch' 2>/dev/null ||
  { echo "vs_pytorch: $py cannot import torch (python3-torch missing; scripts/setup.sh installs it)" >&2; exit 1; }
bench_bin=$build/bench/vs_pytorch_memfit
[[ -x $bench_bin ]] ||
  { echo "vs_pytorch: $bench_bin not found (cmake -S . -B $build -DMEMFIT_BUILD_BENCH=ON && cmake --build $build --target vs_pytorch_memfit)" >&2; exit 1; }

# Blocks after the first (which checkpoint_sequential leaves outside): GPT 2 x layers + head,
# CNN blocks + head.
flag_value() {  # flag_value NAME DEFAULT: the value of NAME among the model flags
  local v=$2 i
  for ((i = 0; i + 1 < ${#model_flags[@]}; i++)); do
    [[ ${model_flags[i]} == "$1" ]] && v=${model_flags[i + 1]}
  done
  echo "$v"
}
if [[ -n $script ]]; then
  # The children of the Sequential after the first; none without Python modules to run them.
  n=$("$py" -c 'import sys, torch; print(len(list(torch.jit.load(sys.argv[1]).children())) - 1)' "$script")
  [[ -n $eager ]] || n=1
elif [[ $model == gpt ]]; then n=$((2 * $(flag_value --layers 8) + 1)); else n=$(($(flag_value --blocks 6) + 1)); fi
[[ -n $segments ]] || segments=$(printf '%s\n' 2 4 8 "$n" | awk -v n="$n" '$1 >= 2 && $1 <= n' | sort -nu | paste -sd' ')
batch=$(flag_value --batch 16)
[[ -n $accums ]] || accums=$(for k in 1 2 4 8 16; do if ((batch % k == 0)); then echo $k; fi; done | paste -sd' ')
# What names the model on each side: built-in flags, or the user's files.
if [[ -n $script ]]; then
  twin_model=(--model script --script "$script" --data "$data" --loss "$loss")
  [[ -z $eager ]] || twin_model+=(--eager "$eager")
  memfit_model=(--model "$script" --data "$data" --loss "$loss")
  name=script_$(basename "$script" .pt)
else
  twin_model=(--model "$model")
  memfit_model=(--model "$model")
  name=$model
fi

# OpenBLAS sizes its pool when it is loaded: set it for both sides before either starts; the
# same OpenMP wait policy and malloc settings for both sides too (see quiet_env.sh).
export OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads
source "$here/quiet_env.sh"
mkdir -p "$out"
jsonl=$out/vs_pytorch_$name.jsonl
: > "$jsonl"
twin() {
  echo "== PyTorch $*" >&2
  "$py" "$here/pytorch_twin.py" "${twin_model[@]}" "${model_flags[@]}" --threads "$threads" --steps "$steps" --json "$@" >> "$jsonl"
}
# The base comparison: the two sides' plain steps run one after the other take minutes, and this
# machine's speed drifts over minutes by more than the differences measured. So PyTorch eager
# and memfit's plain step (the same computation) run alternately, `rounds` times each; the
# table scales memfit's times by that ratio (vs_pytorch_table.py says how).
tag() { "$py" -c 'import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        r = json.loads(line); r["base"] = True; print(json.dumps(r))'; }
base_comparison() {
  local i
  for ((i = 1; i <= rounds; i++)); do
    echo "== base comparison $i/$rounds: PyTorch eager, memfit plain" >&2
    "$py" "$here/pytorch_twin.py" "${twin_model[@]}" "${model_flags[@]}" --threads "$threads" --steps 3 --json --variant eager | tag >> "$jsonl"
    "$bench_bin" "${memfit_model[@]}" "${model_flags[@]}" --threads "$threads" --steps 3 --plain-only 1 | tag >> "$jsonl"
  done
}
if ((base_only)); then
  base_comparison
  echo "command: $command"
  "$py" - "$jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
side = lambda m: [r for r in rows if (r.get("side") == "memfit") == m]
torch_s = [r["median_step_s"] for r in side(False)]
memfit_s = [r["median_step_s"] for r in side(True)]
pairs = ", ".join("%.3f" % (m / t) for t, m in zip(torch_s, memfit_s))
tp, mp = side(False)[0]["peak_bytes"], side(True)[0]["peak_bytes"]
print("time: memfit plain / PyTorch eager = %.3fx (medians of %d rounds; per round %s)"
      % (statistics.median(memfit_s) / statistics.median(torch_s), len(torch_s), pairs))
print("peak: memfit plain %d B, PyTorch eager %d B (%+.2f%%)" % (mp, tp, 100.0 * (mp - tp) / tp))
PY
  exit 0
fi

twin --variant eager
# The grid: every accumulation x segments x precision (eager, the all-defaults point, ran first).
for precision in $precisions; do
  for k in $accums; do
    for s in 0 $segments; do
      parts=()
      ((k > 1)) && parts+=("accum:$k")
      ((s > 0)) && parts+=("ckpt_seq:$s")
      [[ $precision == bf16 ]] && parts+=(autocast_bf16)
      ((${#parts[@]})) || continue
      twin --variant "$(IFS=+; echo "${parts[*]}")"
    done
  done
done

if ((duel)); then
  # Head to head instead of one pass: see vs_pytorch_duel.py.
  printf '%s\n' "${twin_model[@]}" "${model_flags[@]}" > "$out/duel_twin_args.txt"
  printf '%s\n' "${memfit_model[@]}" "${model_flags[@]}" > "$out/duel_memfit_args.txt"
  "$py" "$here/vs_pytorch_duel.py" --jsonl "$jsonl" --twin-args "$out/duel_twin_args.txt" \
    --memfit-args "$out/duel_memfit_args.txt" --memfit "$build/memfit" --threads "$threads" \
    --turns "$duel" --command "$command" --md "$out/vs_pytorch_duel_$name.md"
  rm -f "$out/duel_twin_args.txt" "$out/duel_memfit_args.txt"
  exit 0
fi

eager_peak=$("$py" -c 'import json, sys; print(json.loads(sys.stdin.readline())["peak_bytes"])' < "$jsonl")
budgets=$(for p in 100 90 70 50 35; do echo $((eager_peak * p / 100)); done | paste -sd,)
echo "== memfit, budgets $budgets (100/90/70/50/35% of PyTorch eager's $eager_peak B)" >&2
"$bench_bin" "${memfit_model[@]}" "${model_flags[@]}" --threads "$threads" --steps "$steps" --budgets "$budgets" >> "$jsonl"

base_comparison

"$py" "$here/vs_pytorch_table.py" "$jsonl" --model "$model" --command "$command" \
  --md "$out/vs_pytorch_$name.md" --svg "$out/vs_pytorch_$name.svg"
