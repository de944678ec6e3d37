#!/usr/bin/env bash
# The profile cache (plan/profile_cache.h): a second run of the same job reads the measurements
# and makes the same plan; --replan, a corrupt file and a stale one measure again (with a
# note), another batch is another file, none keeps nothing.
set -u
memfit=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cache="$dir/cache"
small=(--layers 2 --d-model 64 --heads 4 --seq 32 --batch 8)
pass=0; fail=0
ok() { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAILED: $*"; }
py() { "${MEMFIT_TEST_PYTHON:-/usr/bin/python3}" - "$@"; }
plan() { "$memfit" plan "${small[@]}" --budget 40MiB --no-verify --json --profile-cache "$cache" "$@"; }

# 1. First run measures and writes one file; the second reads it and plans the same.
plan > "$dir/first.json" 2> "$dir/first.err" || bad "first plan failed: $(tail -3 "$dir/first.err")"
plan > "$dir/second.json" 2> "$dir/second.err" || bad "second plan failed: $(tail -3 "$dir/second.err")"
files=("$cache"/profile-*.json)
[ "${#files[@]}" -eq 1 ] && [ -s "${files[0]}" ] && ok || bad "expected one cache file, got: ${files[*]}"
py "$dir/first.json" "$dir/second.json" <<'PY' && ok || bad "second run from the cache, same plan"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
assert a["profile_cached"] is False and b["profile_cached"] is True, (a["profile_cached"], b["profile_cached"])
for k in ("config", "predicted", "plain", "floor_bytes", "feasible"):
    assert a[k] == b[k], (k, a[k], b[k])
PY

# 2. --replan measures again (and rewrites the file).
plan --replan > "$dir/replan.json" 2>&1 || bad "replan failed"
py "$dir/replan.json" <<'PY' && ok || bad "--replan measures"
import json, sys
assert json.load(open(sys.argv[1]))["profile_cached"] is False
PY

# 3. A corrupt (truncated) file is ignored with a note, replaced, and read by the next run.
head -c 200 "${files[0]}" > "$dir/trunc" && cp "$dir/trunc" "${files[0]}"
plan > "$dir/corrupt.json" 2>&1 || bad "plan over a corrupt cache failed: $(tail -3 "$dir/corrupt.json")"
plan > "$dir/after.json" 2>&1 || bad "plan after a corrupt cache failed"
py "$dir/corrupt.json" "$dir/after.json" "$dir/first.json" <<'PY' && ok || bad "corrupt file ignored and replaced"
import json, sys
c, d, a = (json.load(open(p)) for p in sys.argv[1:4])
assert c["profile_cached"] is False, c
assert any("ignored: it is not JSON" in n for n in c["notes"]), c["notes"]
assert d["profile_cached"] is True and d["config"] == c["config"], (d, c)  # the plan of the run that measured
PY

# 4. A stale file (its key differs: another thread count recorded) is ignored with a note.
py "${files[0]}" <<'PY' || bad "could not edit the cache file"
import json, sys
j = json.load(open(sys.argv[1])); j["key"]["threads"] = 1000
json.dump(j, open(sys.argv[1], "w"))
PY
plan > "$dir/stale.json" 2>&1 || bad "plan over a stale cache failed"
py "$dir/stale.json" <<'PY' && ok || bad "stale file ignored"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["profile_cached"] is False and any("its key differs" in n for n in s["notes"]), s
PY

# 5. Another batch is another job: a second file.
"$memfit" plan --layers 2 --d-model 64 --heads 4 --seq 32 --batch 12 --budget 40MiB --no-verify --json \
  --profile-cache "$cache" > /dev/null 2> "$dir/b12.err" || bad "plan --batch 12 failed: $(tail -3 "$dir/b12.err")"
n=$(ls "$cache"/profile-*.json | wc -l)
[ "$n" -eq 2 ] && ok || bad "expected two cache files after another batch, got $n"

# 6. train measures what plan measures: it reads the file plan wrote last (step 4) and trains
#    the configuration plan chose from it;
#    with --replan it measures again, and trains the same weights when the plan is the same.
train=(train "${small[@]}" --steps 2 --budget 40MiB --no-progress --report "$dir/r.html" --profile-cache "$cache")
"$memfit" "${train[@]}" --json-log "$dir/t1.jsonl" > "$dir/t1.out" 2>&1 || bad "train failed: $(tail -3 "$dir/t1.out")"
"$memfit" "${train[@]}" --replan --json-log "$dir/t2.jsonl" > "$dir/t2.out" 2>&1 || bad "train --replan failed: $(tail -3 "$dir/t2.out")"
py "$dir/t1.jsonl" "$dir/t2.jsonl" "$dir/stale.json" <<'PY' && ok || bad "train reads plan's measurements; --replan measures"
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
planned = json.load(open(sys.argv[3]))
assert a[-1]["profile_cached"] is True and b[-1]["profile_cached"] is False, (a[-1]["profile_cached"], b[-1]["profile_cached"])
assert a[0]["config"] == planned["config"], (a[0]["config"], planned["config"])
assert a[-1]["planning_seconds"] > 0 and b[-1]["planning_seconds"] > 0
if a[0]["config"] == b[0]["config"]:
    assert a[-1]["weights_sha256"] == b[-1]["weights_sha256"]
PY
grep -q "read from the profile cache" "$dir/t1.out" && ok || bad "train does not say the profile came from the cache"

# 7. none keeps nothing.
MEMFIT_CACHE_DIR="$dir/env-cache" "$memfit" plan "${small[@]}" --budget 40MiB --no-verify --json --profile-cache none > /dev/null 2>&1 || bad "plan --profile-cache none failed"
[ ! -e "$dir/env-cache" ] && ok || bad "--profile-cache none wrote files"

echo "profile_cache: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
