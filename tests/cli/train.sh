#!/usr/bin/env bash
# memfit train end to end on a small GPT: budget held, OOM recovery loses no sample, resume
# continues bit for bit, bad state and bad budgets give one clear line.
set -u
memfit=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
small=(--layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 --no-progress --eval-every 4 --eval-batches 2)
pinned=(--micro-batch 4 --checkpoint none --precision fp32 --optimizer-state fp32)
pass=0; fail=0
ok() { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAILED: $*"; }
py() { "${MEMFIT_TEST_PYTHON:-/usr/bin/python3}" - "$@"; }

# 1. Default budget: the plain step does not fit, the run stays under it, loss falls.
"$memfit" train "${small[@]}" --steps 12 --json-log "$dir/default.jsonl" --report "$dir/r.html" > "$dir/default.out" 2>&1 || bad "default run failed: $(tail -3 "$dir/default.out")"
py "$dir/default.jsonl" <<'PY' && ok || bad "default budget properties"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
plan = lines[0]; summ = lines[-1]; steps = [l for l in lines if l["type"] == "step"]
assert plan["type"] == "plan" and summ["type"] == "summary"
assert plan["plain"]["predicted_peak_bytes"] > plan["budget_bytes"], plan
assert summ["peak_bytes"] <= summ["budget_bytes"], summ
assert steps[-1]["loss"] < steps[0]["loss"], (steps[0]["loss"], steps[-1]["loss"])
assert summ["samples"] == 12 * 8 and len(summ["weights_sha256"]) == 64
PY
[ -s "$dir/r.html" ] && ok || bad "no HTML report written"

# 2. Injected OOMs: same samples, one recovery per injection, training goes on.
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 6 --budget 64MiB --json-log "$dir/plain.jsonl" > /dev/null 2>&1 || bad "uninterrupted run failed"
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 6 --budget 64MiB --inject-oom 2,3,5 --json-log "$dir/inject.jsonl" > "$dir/inject.out" 2>&1 || bad "injected run failed: $(tail -3 "$dir/inject.out")"
py "$dir/plain.jsonl" "$dir/inject.jsonl" <<'PY' && ok || bad "injected OOM properties"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])][-1]
b = [json.loads(l) for l in open(sys.argv[2])][-1]
assert a["samples"] == b["samples"] == 48, (a["samples"], b["samples"])
assert a["oom_recoveries"] == 0 and b["oom_recoveries"] == 3, b
# Recovery recomputes (bit-equal gradients) and restores the random stream: same weights.
assert a["weights_sha256"] == b["weights_sha256"], (a["weights_sha256"], b["weights_sha256"])
assert a["final_loss"] == b["final_loss"]
PY

# 3. A real over-budget case: a pinned micro-batch the budget cannot hold, even recomputing
#    every block, is split and finishes under the budget with every sample.
"$memfit" train "${small[@]}" --micro-batch 8 --checkpoint none --precision fp32 --optimizer-state fp32 --steps 4 --budget 2300KiB --json-log "$dir/real.jsonl" > "$dir/real.out" 2>&1 || bad "real over-budget run failed: $(tail -3 "$dir/real.out")"
grep -q "split into" "$dir/real.out" && ok || bad "real over-budget run did not split: $(cat "$dir/real.out")"
py "$dir/real.jsonl" <<'PY' && ok || bad "real over-budget recovery"
import json, sys
s = [json.loads(l) for l in open(sys.argv[1])][-1]
assert s["oom_recoveries"] >= 1 and s["samples"] == 32 and s["peak_bytes"] <= s["budget_bytes"], s
PY
# The plain step really does not fit the default budget: measured by memfit report.
"$memfit" report --layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 --json > "$dir/plain_report.json" 2>/dev/null
py "$dir/plain_report.json" "$dir/default.jsonl" <<'PY' && ok || bad "plain step fits the default budget"
import json, sys
plain = json.load(open(sys.argv[1]))["peak_bytes"]
plan = json.loads(open(sys.argv[2]).readline())
assert plain > plan["budget_bytes"], (plain, plan["budget_bytes"])
PY

# 4. Resume: 8 steps straight, or 4 + resume to 8: identical losses at 5-8, identical weights.
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 8 --budget 64MiB --json-log "$dir/full.jsonl" > /dev/null 2>&1 || bad "full run failed"
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 4 --budget 64MiB --save "$dir/state" --save-every 2 > /dev/null 2>&1 || bad "first half failed"
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 8 --budget 64MiB --resume "$dir/state" --json-log "$dir/resumed.jsonl" > "$dir/resume.out" 2>&1 || bad "resume failed: $(tail -3 "$dir/resume.out")"
py "$dir/full.jsonl" "$dir/resumed.jsonl" <<'PY' && ok || bad "resume is not bit-exact"
import json, sys
full = [json.loads(l) for l in open(sys.argv[1])]
res = [json.loads(l) for l in open(sys.argv[2])]
fl = {l["step"]: l["loss"] for l in full if l["type"] == "step"}
rl = {l["step"]: l["loss"] for l in res if l["type"] == "step"}
assert sorted(rl) == [5, 6, 7, 8], sorted(rl)
for s in rl: assert fl[s] == rl[s], (s, fl[s], rl[s])
assert full[-1]["weights_sha256"] == res[-1]["weights_sha256"]
PY

# 5. A save killed half-way leaves stray temporaries and an unreferenced state file: the
#    previous state still loads, and the leftovers are removed.
echo "garbage" > "$dir/state/state.json.tmp12345"
echo "garbage" > "$dir/state/state-00000099.pt.tmp12345"
echo "garbage" > "$dir/state/state-00000099.pt"
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 5 --budget 64MiB --resume "$dir/state" > /dev/null 2>&1 && ok || bad "resume beside stray temporaries failed"
left=$(ls "$dir/state" | grep -v '^state-00000004\(\.json\|\.part-[0-9]*\.pt\)$' | grep -v '^state.json$')
[ -z "$left" ] && [ -f "$dir/state/state-00000004.part-0000.pt" ] && ok || bad "leftovers not removed: $(ls "$dir/state")"

# 6. One clear line and a non-zero exit for bad state and bad budgets.
one_line_error() {  # args: expected-text, command...
  local expect=$1; shift
  local err rc; err=$("$@" 2>&1 >/dev/null); rc=$?
  local n; n=$(printf '%s' "$err" | grep -c '')
  if [ $rc -ne 0 ] && [ "$n" -eq 1 ] && [[ "$err" == *"$expect"* ]]; then ok; else bad "$* -> rc=$rc lines=$n: $err"; fi
}
cp -r "$dir/state" "$dir/corrupt"
head -c 3000 "$dir/state/state-00000004.part-0001.pt" > "$dir/corrupt/state-00000004.part-0001.pt"
one_line_error "corrupt or truncated" "$memfit" train "${small[@]}" "${pinned[@]}" --steps 8 --budget 64MiB --resume "$dir/corrupt"
one_line_error "not 'gpt: 3 layers" "$memfit" train --layers 3 --d-model 64 --heads 4 --seq 32 --batch 8 --no-progress "${pinned[@]}" --steps 8 --budget 64MiB --resume "$dir/state"
one_line_error "smallest budget that works is" "$memfit" train "${small[@]}" --steps 2 --budget 1MiB
one_line_error "--budget: invalid size 'lots'" "$memfit" train "${small[@]}" --steps 2 --budget lots
one_line_error "--inject-oom" "$memfit" train "${small[@]}" --steps 2 --inject-oom 0
one_line_error "no saved state" "$memfit" train "${small[@]}" --steps 2 --resume "$dir/nothing-here"

# Progress lines through a pipe: about 20 a run by default, one every K steps with --progress-every.
lines() { "$memfit" train --layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 "${pinned[@]}" --budget 64MiB --eval-every 0 --report "" "$@" 2>/dev/null | grep -c " step [0-9]*/"; }
[ "$(lines --steps 40)" -eq 20 ] && ok || bad "40 steps through a pipe: expected 20 progress lines"
[ "$(lines --steps 5 --progress-every 1)" -eq 5 ] && ok || bad "--progress-every 1: expected a line per step"
[ "$(lines --steps 5 --progress-every 2)" -eq 3 ] && ok || bad "--progress-every 2 over 5 steps: expected steps 2, 4 and 5"

echo "cli train: $pass passed, $fail failed"
[ $fail -eq 0 ]
