#!/usr/bin/env bash
# Nothing lost and nothing silent: evaluation inside the budget, defaults that run, Ctrl-C that
# saves and summarizes, kill -9 during saves that resume exactly, a diverging loss that stops.
set -u
memfit=$(realpath "$1")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
tiny=(--layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 --no-progress)
pinned=(--micro-batch 4 --checkpoint none --precision fp32 --budget 64MiB)
pass=0; fail=0
ok() { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAILED: $*"; }
py() { "${MEMFIT_TEST_PYTHON:-/usr/bin/python3}" - "$@"; }
summary() { py "$1" "$2" <<'PY'
import json, sys
print(json.loads(open(sys.argv[1]).read().splitlines()[-1])[sys.argv[2]])
PY
}

# 1. Small shapes and defaults complete, evaluation included (it runs under the plan's budget).
"$memfit" train "${tiny[@]}" --precision fp32 --budget 2MiB --steps 5 --eval-every 5 --json-log eval.jsonl > eval.out 2>&1 \
  && [ "$(summary eval.jsonl type)" = summary ] && ok || bad "gpt at 2MiB with evaluation: $(tail -2 eval.out)"
"$memfit" train --model cnn --blocks 1 --channels 8 --batch 8 --steps 5 --no-progress --report "" > cnn.out 2>&1 && ok \
  || bad "cnn with its default budget: $(tail -2 cnn.out)"
"$memfit" train --model mlp --steps 2 --no-progress --report "" > mlp.out 2>&1 && ok || bad "mlp defaults: $(tail -2 mlp.out)"

# 2. Ctrl-C: the step finishes, the state is saved, summary + JSON log + HTML are written, exit
#    130; the saved state resumes to the same weights as a run never interrupted.
"$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 100000 --save-every 100000 --save int --json-log int.jsonl \
  --report int.html > int.out 2>&1 &
pid=$!
for _ in $(seq 100); do grep -q "step" int.out 2>/dev/null && break; sleep 0.1; done
sleep 2
kill -INT $pid; wait $pid; rc=$?
stopped=$(summary int.jsonl steps 2>/dev/null)
[ $rc -eq 130 ] && [ "$(summary int.jsonl interrupted)" = True ] && [ -s int.html ] && grep -q "^Summary:" int.out \
  && [ -f int/state.json ] && ok || bad "Ctrl-C: rc=$rc stopped=$stopped $(tail -3 int.out)"
target=$((stopped + 3))
"$memfit" train "${tiny[@]}" "${pinned[@]}" --steps $target --resume int --json-log resumed.jsonl > resumed.out 2>&1 \
  || bad "resume after Ctrl-C: $(tail -2 resumed.out)"
"$memfit" train "${tiny[@]}" "${pinned[@]}" --steps $target --json-log straight.jsonl > straight.out 2>&1 || bad "straight run"
[ "$(summary resumed.jsonl weights_sha256)" = "$(summary straight.jsonl weights_sha256)" ] && ok \
  || bad "resume after Ctrl-C at step $stopped is not exact"

# 3. kill -9 at random moments of a run that saves every step: every resume is exact, and the
#    next run leaves no temporary file behind.
"$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 40 --json-log ref.jsonl > ref.out 2>&1 || bad "reference run"
exact=0
for k in $(seq 10); do
  rm -rf kill
  "$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 40 --save kill --save-every 1 > kill.out 2>&1 &
  pid=$!
  for _ in $(seq 100); do grep -q "step" kill.out 2>/dev/null && break; sleep 0.05; done
  sleep "0.$((RANDOM % 9 + 1))"
  kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
  [ -f kill/state.json ] || continue   # killed before the first save: nothing to resume
  "$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 40 --resume kill --save kill --json-log k.jsonl > k.out 2>&1 \
    || { bad "resume after kill $k: $(tail -2 k.out)"; continue; }
  [ "$(summary k.jsonl weights_sha256)" = "$(summary ref.jsonl weights_sha256)" ] && exact=$((exact+1)) \
    || bad "resume after kill $k is not exact"
  [ -z "$(ls kill | grep -v '^state-00000040\(\.json\|\.part-[0-9]*\.pt\)$' | grep -v '^state.json$')" ] || bad "leftovers after kill $k: $(ls kill)"
done
[ $exact -ge 5 ] && ok || bad "only $exact of 10 kills resumed exactly"
echo "  kill -9 during saving: $exact resumes, all exact"

# 4. A loss that diverges stops the run, naming the step, with the last good state saved.
err=$("$memfit" train "${tiny[@]}" --micro-batch 8 --checkpoint none --precision fp32 --budget 64MiB --lr 1e30 --steps 20 \
  --save div 2>&1 >/dev/null); rc=$?
[ $rc -ne 0 ] && [ "$(printf '%s' "$err" | grep -c '')" -eq 1 ] && [[ "$err" == *"at step"*"diverged"* ]] && [ -f div/state.json ] \
  && ok || bad "diverging loss: rc=$rc $err"

echo "cli reliability: $pass passed, $fail failed"
[ $fail -eq 0 ]
