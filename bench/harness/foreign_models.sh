#!/usr/bin/env bash
# memfit on models its authors did not write (bench/harness/foreign_models.py: torchvision's ResNet-18
# and MobileNetV2, a GPT-2 of traced blocks with tied embeddings): each model's plain step is
# measured, then `memfit plan` runs at 60/45/30% of that peak; each plan is verified with real
# steps (measured <= budget) and its prediction compared with the measurement.
#
#   bash bench/harness/foreign_models.sh MEMFIT [OUT_DIR] [MODEL ...]
#
# Environment: BATCH (32 for the image models, 16 for the GPT: activations well above the
# weights, gradients and AdamW state, so that 30% of the plain step can fit), PRECISION (fp32;
# auto plans bf16 too where autocast runs it), PERCENTS ("60 45 30"), MICRO ("auto": the planner
# picks the micro-batch; sizes listed, e.g. "auto 4", also plan with it pinned). Prints a markdown table
# (and OUT_DIR/foreign_models.jsonl).
set -u
memfit=$(realpath "${1:?usage: foreign_models.sh MEMFIT [OUT_DIR] [MODEL ...]}")
out=${2:-$(mktemp -d)}
shift $(( $# >= 2 ? 2 : 1 ))
here=$(cd "$(dirname "$0")" && pwd)
python=${MEMFIT_TEST_PYTHON:-/usr/bin/python3}
# The batch a model runs: BATCH, or the default for its kind.
batch_of() { case $1 in gpt*) echo "${BATCH:-16}" ;; *) echo "${BATCH:-32}" ;; esac; }
precision=${PRECISION:-fp32}
percents=${PERCENTS:-60 45 30}
micro_batches=${MICRO:-auto}
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(resnet18 mobilenet_v2 gpt2_traced)
source "$here/quiet_env.sh"
mkdir -p "$out"
"$python" "$here/foreign_models.py" "$out" "${models[@]}" 2>/dev/null || { echo "foreign_models.py failed"; exit 1; }
log="$out/foreign_models.jsonl"
: >"$log"

# plan MODEL BUDGET [flags...]: one verified plan as a JSON line in $log; returns memfit's exit.
plan() {
  local model=$1 budget=$2; shift 2
  "$memfit" plan --model "$out/$model.pt" --data "$out/${model}_data.pt" --batch "$(batch_of "$model")" --budget "$budget" \
    --profile-cache "$out/cache" --json "$@" >"$out/plan.json" 2>"$out/err.txt" || return 1
  "$python" - "$out/plan.json" "$model" >>"$log" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
c = j["config"]
print(json.dumps({"model": sys.argv[2], "budget": j["budget_bytes"], "batch": c["batch"], "micro_batch": c["micro_batch"],
                  "precision": c["precision"], "recomputed": c["recomputed_blocks"],
                  "predicted": j["predicted"]["peak_bytes"], "measured": j["measured"]["peak_bytes"]}))
PY
}

failed=()
for model in "${models[@]}"; do
  if ! plan "$model" 1TiB --precision fp32 --micro-batch "$(batch_of "$model")" --checkpoint none; then
    failed+=("$model, plain step: $(tail -1 "$out/err.txt")"); continue
  fi
  plain=$(tail -1 "$log" | "$python" -c 'import json, sys; print(json.load(sys.stdin)["measured"])')
  for micro in $micro_batches; do
    pin=(); [ "$micro" != auto ] && pin=(--micro-batch "$micro")
    for pct in $percents; do
      plan "$model" $((plain * pct / 100)) --precision "$precision" "${pin[@]}" \
        || failed+=("$model at $pct%, micro-batch $micro: $(tail -1 "$out/err.txt")")
    done
  done
done
"$python" - "$log" <<'PY'
import json, sys
rows, plain = [json.loads(l) for l in open(sys.argv[1])], {}
print("| model | budget | plan | predicted | measured | error | measured <= budget |")
print("|---|---:|---|---:|---:|---:|:---:|")
for r in rows:
    if r["model"] not in plain:  # the first row of a model: its plain step
        plain[r["model"]] = r["measured"]
        continue
    share = round(100 * r["budget"] / plain[r["model"]])
    plan = f'{r["precision"]}, {r["micro_batch"]} x {r["batch"] // r["micro_batch"]}, recompute {",".join(map(str, r["recomputed"])) or "none"}'
    error = 100.0 * (r["predicted"] - r["measured"]) / r["measured"]
    ok = "yes" if r["measured"] <= r["budget"] else "NO"
    print(f'| {r["model"]} | {share}% ({r["budget"]} B) | {plan} | {r["predicted"]} | {r["measured"]} | {error:+.2f}% | {ok} |')
print()
print("plain steps (measured):", ", ".join(f"{m} {b} B" for m, b in plain.items()))
PY
for f in "${failed[@]}"; do echo "failed: $f"; done
[ ${#failed[@]} -eq 0 ]
