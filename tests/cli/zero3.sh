#!/usr/bin/env bash
# memfit train at ZeRO 3 on loopback (c10d/Gloo): 2 and 4 ranks give the weights of
# single-process training bit for bit (gradients are summed in rank order); each rank holds
# ~1/N of the weights, gradients and AdamW state (tracker bytes) and peaks within 5% of its
# plan; a model whose single-process floor exceeds a budget B trains on 2 ranks under B; a
# killed rank makes the other fail with one clear line; save + resume equal straight training.
set -u
memfit=$(realpath "$1")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
model=(--layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 --dropout 0)
quiet=(--no-progress --eval-every 0)  # train's own flags
base=("${model[@]}" "${quiet[@]}")
small=("${base[@]}" --report "")  # no HTML report, except where one is checked
pinned=(--checkpoint all --precision fp32 --budget 64MiB --optimizer-state fp32)
source "$(dirname "$(realpath "$0")")/lib.sh"

# 1. 10 steps, one process (micro-batches of 4) against 2 ranks at stage 3 (4 samples each).
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 10 --micro-batch 4 --threads 1 --json-log single.jsonl \
  --dump-weights single.bin > single.out 2>&1 || bad "single-process run failed: $(tail -3 single.out)"
"$memfit" launch --nproc 2 -- train "${base[@]}" "${pinned[@]}" --steps 10 --micro-batch 4 --zero 3 --json-log z3.jsonl \
  --dump-weights z3.bin --report z3.html > z3.out 2>&1 || bad "stage 3 run failed: $(tail -5 z3.out)"
# bf16 autocast: each block's weight casts are made while it is gathered (the cast cache
# is cleared around gathers), the same values as one process's cached casts.
bf16=("${small[@]}" --checkpoint all --precision bf16 --budget 64MiB --steps 3 --micro-batch 4)
"$memfit" train "${bf16[@]}" --threads 1 --dump-weights single_bf16.bin > single_bf16.out 2>&1 \
  || bad "single-process bf16 run failed: $(tail -3 single_bf16.out)"
"$memfit" launch --nproc 2 -- train "${bf16[@]}" --zero 3 --dump-weights z3_bf16.bin > z3_bf16.out 2>&1 \
  || bad "stage 3 bf16 run failed: $(tail -5 z3_bf16.out)"
# 4 ranks (2 samples each), a smaller model and 3 steps: 2 cores run 4 processes.
tiny=(--layers 1 --d-model 32 --heads 2 --seq 16 --batch 8 --dropout 0 "${quiet[@]}" --report "")
"$memfit" train "${tiny[@]}" "${pinned[@]}" --steps 3 --micro-batch 2 --threads 1 --dump-weights tiny.bin > tiny.out 2>&1 \
  || bad "single-process tiny run failed: $(tail -3 tiny.out)"
"$memfit" launch --nproc 4 -- train "${tiny[@]}" "${pinned[@]}" --steps 3 --micro-batch 2 --zero 3 --dump-weights tiny_z3n4.bin \
  > tiny_z3n4.out 2>&1 || bad "4-rank stage 3 run failed: $(tail -5 tiny_z3n4.out)"

# Every prefetch depth, with 2 micro-batches per rank: the same sums in the same order, so the
# same bits (depth 0 sums along the chain of sends, depths 1-2 while the next block computes).
for depth in 0 1 2; do
  "$memfit" launch --nproc 2 -- train "${small[@]}" "${pinned[@]}" --steps 4 --micro-batch 2 --zero 3 --prefetch-depth $depth \
    --json-log depth$depth.jsonl --dump-weights depth$depth.bin > depth$depth.out 2>&1 \
    || bad "stage 3 at prefetch depth $depth failed: $(tail -5 depth$depth.out)"
done
cmp -s depth0.bin depth1.bin && cmp -s depth0.bin depth2.bin && ok || bad "prefetch depths 0, 1, 2 trained different weights"

py <<'PY' && ok || bad "stage 3 weights differ from single-process training"
import array
def load(path):
    a = array.array("f"); a.frombytes(open(path, "rb").read()); return a
def compare(ref_path, path, bit_exact):
    ref, got = load(ref_path), load(path)
    assert len(ref) == len(got) > 0, (len(ref), len(got))
    scale = max(abs(x) for x in ref)
    rel = max(abs(x - y) for x, y in zip(ref, got)) / scale
    print(f"  {path} vs {ref_path}: max |difference| / max |weight| = {rel:.3g}, bit-exact {ref == got}")
    assert rel <= 1e-6, (path, rel)
    assert ref == got or not bit_exact, path
compare("single.bin", "z3.bin", True)
compare("tiny.bin", "tiny_z3n4.bin", True)
compare("single_bf16.bin", "z3_bf16.bin", True)
PY

# 2. Per rank: weights + gradients + optimizer state ~ single / 2 (tracker bytes at the
#    optimizer step), and the measured peak within 5% of the plan's prediction (rank 0 from its
#    log, rank 1 from its printed summary).
py single.jsonl z3.jsonl z3.out <<'PY' && ok || bad "stage 3 bytes per rank or peak vs plan"
import json, re, sys
def summary(path):
    s = [json.loads(l) for l in open(path)][-1]
    assert s["type"] == "summary", s
    return s
single, z3 = summary(sys.argv[1]), summary(sys.argv[2])
one = single["ranks"][0]
total = one["weights"] + one["gradients"] + one["optimizer_state"]
assert z3["world_size"] == 2 and z3["zero_stage"] == 3 and len(z3["ranks"]) == 2, z3
for r in z3["ranks"]:
    mine = r["weights"] + r["gradients"] + r["optimizer_state"]
    print(f"  rank {r['rank']}: weights {r['weights']} + gradients {r['gradients']} + AdamW state {r['optimizer_state']}"
          f" = {mine} B = {mine / (total / 2):.4f} x single/2")
    assert abs(mine / (total / 2) - 1) <= 0.05, r
    for k in ("weights", "gradients", "optimizer_state"):
        assert abs(r[k] / (one[k] / 2) - 1) <= 0.05, (k, r, one)
measured, predicted = z3["peak_bytes"], z3["plan"]["predicted"]["peak_bytes"]
print(f"  rank 0: measured peak {measured} B, predicted {predicted} B: {measured / predicted:.4f}")
assert abs(measured / predicted - 1) <= 0.05, (measured, predicted)
out = open(sys.argv[3]).read()
pred = re.search(r"\[rank 1\]   predicted peak +[\d.]+ \w+ +(\d+) B", out)
peak = re.search(r"\[rank 1\]   peak [\d.]+ \w+ \((\d+) bytes\)", out)
assert pred and peak, "rank 1 printed no plan or summary"
p1, m1 = int(pred.group(1)), int(peak.group(1))
print(f"  rank 1: measured peak {m1} B, predicted {p1} B: {m1 / p1:.4f}")
assert abs(m1 / p1 - 1) <= 0.05, (m1, p1)
PY

# At each prefetch depth: the plan runs it, and rank 0 peaks within 5% of the plan's prediction
# (which counts the blocks in flight).
py depth0.jsonl depth1.jsonl depth2.jsonl <<'PY' && ok || bad "stage 3 peak vs plan at a prefetch depth"
import json, sys
for depth, path in enumerate(sys.argv[1:]):
    s = [json.loads(l) for l in open(path)][-1]
    assert s["plan"]["config"]["prefetch_depth"] == depth, s["plan"]["config"]
    measured, predicted = s["peak_bytes"], s["plan"]["predicted"]["peak_bytes"]
    print(f"  prefetch depth {depth}: rank 0 measured peak {measured} B, predicted {predicted} B: {measured / predicted:.4f}")
    assert abs(measured / predicted - 1) <= 0.05, (depth, measured, predicted)
PY

# The HTML report's rank table at stage 3, with the gathered block.
py z3.html <<'PY' && ok || bad "HTML report of a stage 3 run lacks the per-rank table or the gathered block"
import sys
html = open(sys.argv[1]).read()
table = html[html.index('id="ranks-table"'):]
assert table[:table.index("</table>")].count("<tr><td>") == 2
assert "State per rank (ZeRO stage 3)" in html and 'id="ranks-gathered"' in html
PY

# 3. `memfit report --world-size 2 --zero 3` predicts each rank's shard and the largest block.
"$memfit" report "${model[@]}" --steps 2 --world-size 2 --zero 3 > report.out 2>&1 || bad "report at stage 3 failed: $(tail -3 report.out)"
grep -q "2 ranks at ZeRO stage 3" report.out && grep -q "the largest block gathered in full" report.out && ok \
  || bad "report at stage 3: $(grep -A4 'State per rank' report.out)"

# 4. A budget B below the single-process floor: one process cannot train, 2 ranks at stage 3
#    can, saving every step and resuming, each rank's peak under B. The model is weight-heavy
#    (AdamW: 16 bytes per parameter).
heavy=(--layers 4 --d-model 256 --heads 4 --seq 16 --batch 4 --dropout 0 --precision fp32 --optimizer-state fp32)
"$memfit" plan "${heavy[@]}" --budget 1MiB > floor.out 2>&1
floor=$(grep -o "smallest budget that works is [^(]*(\([0-9]*\) bytes)" floor.out | grep -o "([0-9]*" | tr -d '(' | head -1)
if [ -z "$floor" ]; then
  bad "memfit plan named no floor: $(tail -3 floor.out)"
else
  budget=$((floor * 85 / 100))
  "$memfit" train "${heavy[@]}" "${quiet[@]}" --report "" --budget "$budget" --steps 2 --threads 1 > heavy_single.out 2>&1 \
    && bad "one process trained under $budget bytes, below its floor $floor" || ok
  # Saving every step (block by block: rank 0 never holds the whole model), then resuming.
  "$memfit" launch --nproc 2 -- train "${heavy[@]}" "${quiet[@]}" --report "" --budget "$budget" --steps 2 --zero 3 \
    --save heavy_st --save-every 1 > heavy_z3.out 2>&1 || bad "stage 3 under $budget bytes (floor $floor) failed: $(tail -5 heavy_z3.out)"
  "$memfit" launch --nproc 2 -- train "${heavy[@]}" "${quiet[@]}" --report "" --budget "$budget" --steps 3 --zero 3 \
    --resume heavy_st > heavy_resume.out 2>&1 || bad "stage 3 resume under $budget bytes failed: $(tail -5 heavy_resume.out)"
  [ -f heavy_st/state-00000002.part-0001.pt ] && ok || bad "no saved parts: $(ls heavy_st)"
  for out in heavy_z3.out heavy_resume.out; do
    py "$budget" "$floor" $out <<'PY' && ok || bad "stage 3 ranks over the budget ($out)"
import re, sys
budget, floor, out = int(sys.argv[1]), int(sys.argv[2]), open(sys.argv[3]).read()
peaks = {int(r): int(b) for r, b in re.findall(r"\[rank (\d)\]   peak [\d.]+ \w+ \((\d+) bytes\)", out)}
assert sorted(peaks) == [0, 1], peaks
for r, p in sorted(peaks.items()):
    print(f"  {sys.argv[3]}: single-process floor {floor} B; budget {budget} B; rank {r} peak {p} B ({p / budget:.3f} of the budget)")
    assert p <= budget, (r, p, budget)
PY
  done
fi

# 5. A rank killed mid-run at stage 3: the other exits non-zero with one line naming the failed
#    collective (its gathers and gradient sums fail).
long=("${model[@]}" --eval-every 0 --report "" "${pinned[@]}" --steps 100000 --zero 3 --threads 1 --world-size 2
      --master 127.0.0.1:$(free_port) --dist-timeout 10 --progress-every 1)
"$memfit" train "${long[@]}" --rank 0 > kill0.out 2>&1 & r0=$!
"$memfit" train "${long[@]}" --rank 1 > kill1.out 2>&1 & r1=$!
disown $r1  # (its death by SIGKILL is the point: no job-control message)
wait_for_line kill1.out "step 1/" || bad "stage 3 rank 1 did not train: $(tail -3 kill1.out)"
kill -9 $r1
wait $r0; rc=$?
echo "  stage 3: rank 0 after rank 1 was killed (rc $rc): $(tail -1 kill0.out)"
[ $rc -ne 0 ] && tail -1 kill0.out | grep -q "^memfit: rank 0: .* failed: " && ok || bad "stage 3 rank 0 after a killed peer: rc=$rc $(tail -2 kill0.out)"
kill -9 $r0 2>/dev/null

# 6. Save and resume at stage 3 (2 + 2 steps = 4 straight, bit for bit); the saved file is the
#    single-process format both ways (one process resumes from a stage 3 save, stage 3 from a
#    single-process save); another family (SGD with momentum) too.
four=("${small[@]}" "${pinned[@]}" --micro-batch 4)
"$memfit" train "${four[@]}" --steps 4 --threads 1 --dump-weights single4.bin > single4.out 2>&1 || bad "single 4 steps: $(tail -3 single4.out)"
"$memfit" launch --nproc 2 -- train "${four[@]}" --steps 2 --zero 3 --save st > save.out 2>&1 || bad "stage 3 save: $(tail -5 save.out)"
"$memfit" launch --nproc 2 -- train "${four[@]}" --steps 4 --zero 3 --resume st --dump-weights resumed.bin > resume.out 2>&1 \
  || bad "stage 3 resume: $(tail -5 resume.out)"
"$memfit" train "${four[@]}" --steps 4 --threads 1 --resume st --dump-weights single_resumed.bin > single_resume.out 2>&1 \
  || bad "single-process resume from a stage 3 save: $(tail -3 single_resume.out)"
"$memfit" train "${four[@]}" --steps 2 --threads 1 --save st1 > single_save.out 2>&1 || bad "single save: $(tail -3 single_save.out)"
"$memfit" launch --nproc 2 -- train "${four[@]}" --steps 4 --zero 3 --resume st1 --dump-weights resumed1.bin > resume1.out 2>&1 \
  || bad "stage 3 resume from a single-process save: $(tail -5 resume1.out)"
for f in resumed.bin single_resumed.bin resumed1.bin; do
  cmp -s "$f" single4.bin && ok || bad "$f differs from 4 straight single-process steps"
done
sgd=("${four[@]}" --optimizer sgd --momentum 0.9 --lr 0.05)
"$memfit" train "${sgd[@]}" --steps 4 --threads 1 --dump-weights sgd4.bin > sgd4.out 2>&1 || bad "single SGD: $(tail -3 sgd4.out)"
"$memfit" launch --nproc 2 -- train "${sgd[@]}" --steps 2 --zero 3 --save sgd_st > sgd_save.out 2>&1 || bad "stage 3 SGD save: $(tail -5 sgd_save.out)"
"$memfit" launch --nproc 2 -- train "${sgd[@]}" --steps 4 --zero 3 --resume sgd_st --dump-weights sgd_resumed.bin > sgd_resume.out 2>&1 \
  || bad "stage 3 SGD resume: $(tail -5 sgd_resume.out)"
cmp -s sgd_resumed.bin sgd4.bin && ok || bad "stage 3 SGD save + resume differs from 4 straight single-process steps"

# 7. Refused at stage 3, in one line: a schedule other than every block recomputed, and 8-bit
#    state when saving.
err=$("$memfit" train "${small[@]}" --budget 64MiB --world-size 2 --zero 3 --checkpoint none 2>&1 >/dev/null); rc=$?
[ $rc -ne 0 ] && [[ "$err" == *"ZeRO 3 recomputes every block: expected all"* ]] && ok || bad "--checkpoint none at stage 3: rc=$rc $err"
err=$("$memfit" train "${small[@]}" --budget 64MiB --world-size 2 --zero 3 --optimizer-state 8bit --save st8 2>&1 >/dev/null); rc=$?
[ $rc -ne 0 ] && [[ "$err" == *"saving and resuming at ZeRO 3 need fp32 state"* ]] && ok || bad "8-bit state with --save at stage 3: rc=$rc $err"

echo "cli zero3: $pass passed, $fail failed"
[ $fail -eq 0 ]
