#!/usr/bin/env bash
# Nothing lost and nothing silent: evaluation inside the budget, defaults that run, Ctrl-C that
# saves and summarizes, a crash at every point of a save that resumes exactly, a diverging loss
# that stops.
set -u
memfit=$(realpath "$1")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
model=(--layers 2 --d-model 64 --heads 4 --seq 32 --batch 8)
tiny=("${model[@]}" --no-progress)
pinned=(--micro-batch 4 --checkpoint none --precision fp32 --optimizer-state fp32 --budget 64MiB)
source "$(dirname "$(realpath "$0")")/lib.sh"

# 1. Small shapes and defaults complete, evaluation included (it runs under the plan's budget).
"$memfit" train "${tiny[@]}" --precision fp32 --budget 3MiB --steps 5 --eval-every 5 --json-log eval.jsonl > eval.out 2>&1 \
  && [ "$(summary eval.jsonl type)" = summary ] && ok || bad "gpt at 2MiB with evaluation: $(tail -2 eval.out)"
"$memfit" train --model cnn --blocks 1 --channels 8 --batch 8 --steps 5 --no-progress --report "" > cnn.out 2>&1 && ok \
  || bad "cnn with its default budget: $(tail -2 cnn.out)"
"$memfit" train --model mlp --steps 2 --no-progress --report "" > mlp.out 2>&1 && ok || bad "mlp defaults: $(tail -2 mlp.out)"

# 2. Ctrl-C: the step finishes, the state is saved, summary + JSON log + HTML are written, exit
#    130; the saved state resumes to the same weights as a run never interrupted.
"$memfit" train "${model[@]}" --progress-every 1 "${pinned[@]}" --steps 100000 --save-every 100000 --save int \
  --json-log int.jsonl --report int.html > int.out 2>&1 &
pid=$!
wait_for_line int.out "step 3/" || bad "the run to interrupt did not train: $(tail -3 int.out)"
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

# 3. A crash (SIGKILL) at each point of a save, in turn: the temporary of the first and of the
#    last part written, each renamed into place, the head, the manifest (the commit point). Each
#    run saves every step and dies in step 3's save; resuming gives the weights of a run never
#    interrupted, and leaves no temporary behind.
"$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 6 --json-log ref.jsonl > ref.out 2>&1 || bad "reference run"
"$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 1 --save parts > parts.out 2>&1 || bad "a save to count parts"
last_part=$(ls parts | grep -o 'part-[0-9]*' | sort | tail -1)
points=()
for file in "state-00000003.part-0000.pt" "state-00000003.$last_part.pt" "state-00000003.json" "state.json"; do
  points+=("3:$file:written" "3:$file:renamed")
done
exact=0
for point in "${points[@]}"; do
  rm -rf crash
  { MEMFIT_CRASH_POINT=$point "$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 6 --save crash --save-every 1 > crash.out 2>&1; } 2>/dev/null
  rc=$?  # (the shell's "Killed" line went to /dev/null: the crash is the point)
  [ $rc -eq 137 ] || { bad "no crash at $point (rc $rc): $(tail -2 crash.out)"; continue; }
  "$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 6 --resume crash --save crash --json-log c.jsonl > c.out 2>&1 \
    || { bad "resume after a crash at $point: $(tail -2 c.out)"; continue; }
  [ "$(summary c.jsonl weights_sha256)" = "$(summary ref.jsonl weights_sha256)" ] && exact=$((exact+1)) \
    || bad "resume after a crash at $point is not exact"
  [ -z "$(ls crash | grep -v '^state-00000006\(\.json\|\.part-[0-9]*\.pt\)$' | grep -v '^state.json$')" ] \
    || bad "leftovers after a crash at $point: $(ls crash)"
done
[ $exact -eq ${#points[@]} ] && ok || bad "only $exact of ${#points[@]} crashes resumed exactly"
echo "  a crash at each of ${#points[@]} points of a save: $exact resumes, all exact"

# 4. A loss that diverges stops the run, naming the step, with the last good state saved.
err=$("$memfit" train "${tiny[@]}" --micro-batch 8 --checkpoint none --precision fp32 --budget 64MiB --lr 1e30 --steps 20 \
  --save div 2>&1 >/dev/null); rc=$?
[ $rc -ne 0 ] && [ "$(printf '%s' "$err" | grep -c '')" -eq 1 ] && [[ "$err" == *"at step"*"diverged"* ]] && [ -f div/state.json ] \
  && ok || bad "diverging loss: rc=$rc $err"

echo "cli reliability: $pass passed, $fail failed"
[ $fail -eq 0 ]
