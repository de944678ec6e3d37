#!/usr/bin/env bash
# memfit train over 2 ranks on loopback (c10d/Gloo): ZeRO stages 0, 1, 2 give the weights of
# single-process training on the same global batch; AdamW state per rank ~1/2 (stages 1, 2)
# and gradients per rank ~1/2 (stage 2); rank 0 saves the single-process format and resume
# works; a killed or stopped rank makes the others fail with one clear line; the launcher
# prefixes, forwards signals and fails all; bad flags give one clear line.
set -u
memfit=$(realpath "$1")
dir=$(mktemp -d)
bg=()  # background processes this script started, killed at exit
cleanup() {
  for p in "${bg[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$dir"
}
trap cleanup EXIT
cd "$dir" || exit 1
model=(--layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 --dropout 0)
base=("${model[@]}" --no-progress --eval-every 0)
small=("${base[@]}" --report "")  # no HTML report, except where one is checked
pinned=(--checkpoint none --precision fp32 --optimizer-state fp32 --budget 64MiB)
source "$(dirname "$(realpath "$0")")/lib.sh"

# 1. Single process, the reference: micro-batches of 4, so 2 per step.
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 4 --micro-batch 4 --threads 1 --json-log single.jsonl --dump-weights single.bin \
  > single.out 2>&1 || bad "single-process run failed: $(tail -3 single.out)"

# 2. Two ranks, each 4 samples (one micro-batch) of the same global batch of 8, stages 0, 1, 2.
for z in 0 1 2; do
  "$memfit" launch --nproc 2 -- train "${base[@]}" "${pinned[@]}" --steps 4 --micro-batch 4 --zero $z --json-log z$z.jsonl \
    --dump-weights z$z.bin --report z$z.html > z$z.out 2>&1 || bad "stage $z run failed: $(tail -5 z$z.out)"
done
# A case that is not bit-exact: 3 ranks (3 + 3 + 2 samples), micro-batches of 2, stage 2,
# against one process taking the batch of 8 at once.
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 4 --micro-batch 8 --threads 1 --dump-weights single8.bin > single8.out 2>&1 \
  || bad "single-process run (micro-batch 8) failed: $(tail -3 single8.out)"
"$memfit" launch --nproc 3 -- train "${small[@]}" "${pinned[@]}" --steps 4 --micro-batch 2 --zero 2 --dump-weights z2n3.bin \
  > z2n3.out 2>&1 || bad "3-rank stage 2 run failed: $(tail -5 z2n3.out)"
# Another optimizer family: SGD with momentum, one process against ZeRO 2 over 2 ranks; and
# its sharded state gathered for saving, then resumed by one process.
sgd=(--optimizer sgd --momentum 0.9 --lr 0.05)
"$memfit" train "${small[@]}" "${pinned[@]}" "${sgd[@]}" --steps 4 --micro-batch 4 --threads 1 --dump-weights sgd_single.bin \
  > sgd_single.out 2>&1 || bad "single-process SGD run failed: $(tail -3 sgd_single.out)"
"$memfit" launch --nproc 2 -- train "${small[@]}" "${pinned[@]}" "${sgd[@]}" --steps 2 --micro-batch 4 --zero 2 --save sgd_state \
  > sgd_save.out 2>&1 || bad "SGD stage 2 save failed: $(tail -5 sgd_save.out)"
"$memfit" launch --nproc 2 -- train "${small[@]}" "${pinned[@]}" "${sgd[@]}" --steps 4 --micro-batch 4 --zero 2 --resume sgd_state \
  --dump-weights sgd_z2.bin > sgd_z2.out 2>&1 || bad "SGD stage 2 resume failed: $(tail -5 sgd_z2.out)"

py <<'PY' && ok || bad "weights differ from single-process training"
import array, math, sys
def load(path):
    a = array.array("f"); a.frombytes(open(path, "rb").read()); return a
def compare(ref_path, path):
    ref, got = load(ref_path), load(path)
    assert len(ref) == len(got) > 0, (len(ref), len(got))
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(ref, got)))
    norm = math.sqrt(sum(x * x for x in ref))
    worst = max(abs(x - y) for x, y in zip(ref, got))
    rel = diff / norm
    print(f"  {path} vs {ref_path}: relative L2 difference {rel:.3g}, max abs difference {worst:.3g}, bit-exact {ref == got}")
    assert rel <= 1e-5, (path, rel)
for z in ("z0.bin", "z1.bin", "z2.bin"):
    compare("single.bin", z)
compare("single8.bin", "z2n3.bin")
compare("sgd_single.bin", "sgd_z2.bin")
PY

# Rank 0's HTML report shows both ranks' state.
py z2.html <<'PY' && ok || bad "HTML report of a 2-rank run lacks the per-rank table"
import sys
html = open(sys.argv[1]).read()
table = html[html.index('id="ranks-table"'):]
assert table[:table.index("</table>")].count("<tr><td>") == 2
PY

# 3. State bytes per rank, measured by the tracker at the last optimizer step.
py single.jsonl z0.jsonl z1.jsonl z2.jsonl <<'PY' && ok || bad "state bytes per rank"
import json, sys
def ranks(path):
    s = [json.loads(l) for l in open(path)][-1]
    assert s["type"] == "summary", s
    return s["ranks"], s
single, s1 = ranks(sys.argv[1])
opt, grads, weights = single[0]["optimizer_state"], single[0]["gradients"], single[0]["weights"]
assert opt == 2 * weights and grads == weights, single
losses = []
for stage, path in ((0, sys.argv[2]), (1, sys.argv[3]), (2, sys.argv[4])):
    rs, s = ranks(path)
    assert s["world_size"] == 2 and s["zero_stage"] == stage and len(rs) == 2, s
    losses.append(s["final_loss"])
    for r in rs:
        assert r["weights"] == weights, r
        if stage == 0:
            assert r["optimizer_state"] == opt and r["gradients"] == grads, r
        else:
            share = r["optimizer_state"] / (opt / 2)
            print(f"  stage {stage} rank {r['rank']}: optimizer state {r['optimizer_state']} B = {share:.3f} x single/2")
            assert abs(share - 1) <= 0.05, (stage, r)
        if stage == 2:
            share = r["gradients"] / (grads / 2)
            print(f"  stage 2 rank {r['rank']}: gradients after reduction {r['gradients']} B = {share:.3f} x single/2")
            assert abs(share - 1) <= 0.05, r
        if stage == 1:
            assert r["gradients"] == grads, r
    if stage > 0:
        assert sum(r["optimizer_state"] for r in rs) == opt, rs
    if stage == 2:
        assert sum(r["gradients"] for r in rs) == grads, rs
# The logged loss is the global batch's mean, as in a single process.
for l in losses: assert abs(l - s1["final_loss"]) <= 1e-6 * abs(s1["final_loss"]), (l, s1["final_loss"])
PY
grep -q "rank 1: weights 430 KiB, gradients" z2.out && ok || bad "summary shows no per-rank state bytes: $(grep -A3 'state at' z2.out)"

# 4. Output lines carry their rank; only rank 0 writes the log.
py z1.out <<'PY' && ok || bad "launcher output is not prefixed by rank"
import sys
lines = open(sys.argv[1]).read().splitlines()
assert lines[0].startswith("memfit launch: 2 ranks"), lines[0]
assert all(l.startswith(("[rank 0] ", "[rank 1] ")) for l in lines[1:]), [l for l in lines[1:] if not l.startswith("[rank")]
assert any(l.startswith("[rank 1] ") for l in lines) and any(l.startswith("[rank 0] ") for l in lines)
PY

# 5. Save and resume at stage 2: 2 steps + 2 resumed equal 4 straight; the saved file is the
#    single-process format (a single process resumes from it to the same weights).
"$memfit" launch --nproc 2 -- train "${small[@]}" "${pinned[@]}" --micro-batch 4 --zero 2 --steps 2 --save state > save.out 2>&1 \
  || bad "stage 2 save failed: $(tail -5 save.out)"
"$memfit" launch --nproc 2 -- train "${small[@]}" "${pinned[@]}" --steps 4 --micro-batch 4 --zero 2 --resume state --dump-weights resumed.bin \
  > resume.out 2>&1 || bad "stage 2 resume failed: $(tail -5 resume.out)"
"$memfit" train "${small[@]}" "${pinned[@]}" --steps 4 --micro-batch 4 --threads 1 --resume state --dump-weights single_resumed.bin \
  > single_resume.out 2>&1 || bad "single-process resume from a stage 2 save failed: $(tail -3 single_resume.out)"
cmp -s resumed.bin z2.bin && ok || bad "stage 2 resume differs from the uninterrupted run"
cmp -s single_resumed.bin single.bin && ok || bad "single-process resume from the sharded save differs from single-process training"

# start_pair NAME DIST_TIMEOUT: ranks 0 and 1 of a long run in the background (output in NAME0.out
# and NAME1.out, pids in r0 and r1), returning once rank 1 has finished a training step.
start_pair() {
  local port; port=$(free_port)
  # (progress lines on: each step's line is the sign that training runs)
  local long=("${model[@]}" --eval-every 0 --report "" --budget 64MiB --steps 100000 --threads 1 --world-size 2
              --master 127.0.0.1:$port --dist-timeout "$2" --progress-every 1)
  "$memfit" train "${long[@]}" --rank 0 > "$1"0.out 2>&1 & r0=$!; bg+=($r0)
  "$memfit" train "${long[@]}" --rank 1 > "$1"1.out 2>&1 & r1=$!; bg+=($r1)
  wait_for_line "$1"1.out "step 1/" || bad "rank 1 did not train: $(cat "$1"1.out)"
}

# 6. A rank killed mid-run: the other exits non-zero with one line naming the failed collective.
start_pair kill 10
kill -9 $r1
wait $r0; rc=$?
echo "  rank 0 after rank 1 was killed (rc $rc): $(tail -1 kill0.out)"
[ $rc -ne 0 ] && tail -1 kill0.out | grep -q "^memfit: rank 0: .* failed: " && ok || bad "rank 0 after a killed peer: rc=$rc $(tail -2 kill0.out)"

# A rank that stops answering (SIGSTOP) rather than dying: the other fails on its collective's
# timeout (--dist-timeout) and says so.
start_pair stop 3
kill -STOP $r1
wait $r0; rc=$?
kill -9 $r1
echo "  rank 0 after rank 1 was stopped (rc $rc): $(tail -1 stop0.out)"
[ $rc -ne 0 ] && tail -1 stop0.out | grep -q "^memfit: rank 0: .* failed: .*timeout 3 s)" && ok \
  || bad "rank 0 after a stopped peer: rc=$rc $(tail -2 stop0.out)"

# 7. The launcher: a killed rank fails all (non-zero, others stopped); SIGINT is forwarded.
"$memfit" launch --nproc 2 -- train "${small[@]}" --budget 64MiB --steps 100000 --dist-timeout 10 > launch_kill.out 2>&1 & lp=$!; bg+=($lp)
wait_for_line launch_kill.out "[rank 1] Plan for a budget" || bad "launched rank 1 did not start: $(cat launch_kill.out)"
children=$(pgrep -P $lp | tr '\n' ' ')
victim=$(pgrep -P $lp -f -- "--rank 1\$")
kill -9 "$victim"
wait $lp; rc=$?
alive=0; for c in $children; do kill -0 "$c" 2>/dev/null && alive=1; done
[ $rc -ne 0 ] && [ $alive -eq 0 ] && grep -q "memfit launch: rank 1 was killed by signal 9; stopping the other ranks" launch_kill.out && ok \
  || bad "launcher after a killed rank: rc=$rc alive=$alive $(tail -3 launch_kill.out)"

"$memfit" launch --nproc 2 -- train "${small[@]}" --budget 64MiB --steps 100000 > launch_int.out 2>&1 & lp=$!; bg+=($lp)
wait_for_line launch_int.out "[rank 1] Plan for a budget" || bad "launched rank 1 did not start: $(cat launch_int.out)"
children=$(pgrep -P $lp | tr '\n' ' ')
kill -INT $lp
wait $lp; rc=$?
alive=0; for c in $children; do kill -0 "$c" 2>/dev/null && alive=1; done
[ $rc -eq 130 ] && [ $alive -eq 0 ] && grep -q "forwarding it to every rank" launch_int.out && ok \
  || bad "SIGINT to the launcher: rc=$rc alive=$alive $(tail -3 launch_int.out)"

# 8. Bad flags: one clear line, non-zero exit, in bounded time.
one_line_error() {  # args: expected-text, command...
  local expect=$1; shift
  local err rc; err=$("$@" 2>&1 >/dev/null); rc=$?
  local n; n=$(printf '%s' "$err" | grep -c '')
  if [ $rc -ne 0 ] && [ "$n" -eq 1 ] && [[ "$err" == *"$expect"* ]]; then ok; else bad "$* -> rc=$rc lines=$n: $err"; fi
}
quick=("${small[@]}" --budget 64MiB --threads 1)
one_line_error "invalid --rank 2: expected 0 to 1" "$memfit" train "${quick[@]}" --world-size 2 --rank 2
one_line_error "invalid --zero 4" "$memfit" train "${quick[@]}" --world-size 2 --zero 4
one_line_error "invalid --master 'nowhere'" "$memfit" train "${quick[@]}" --world-size 2 --master nowhere
port=$(free_port)
one_line_error "rank 1: cannot reach the rendezvous at 127.0.0.1:$port within 2 s" "$memfit" train "${quick[@]}" --world-size 2 --rank 1 --master 127.0.0.1:$port --dist-timeout 2
one_line_error "timed out after 2 s waiting for the other ranks to join at 127.0.0.1:" "$memfit" train "${quick[@]}" --world-size 2 --rank 0 --master 127.0.0.1:$(free_port) --dist-timeout 2
# Port in use: something else listens there.
py > held.port <<'PY' &
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(60)
PY
holder=$!; bg+=($holder)
wait_for_line held.port ""
one_line_error "rank 0: cannot open the rendezvous at 127.0.0.1:$(cat held.port)" "$memfit" train "${quick[@]}" --world-size 2 --rank 0 --master 127.0.0.1:$(cat held.port) --dist-timeout 2
kill $holder 2>/dev/null
# Ranks started with different flags: caught before training, on every rank.
port=$(free_port)
"$memfit" train "${quick[@]}" --world-size 2 --rank 1 --master 127.0.0.1:$port --steps 3 --dist-timeout 20 > mismatch1.out 2>&1 & m1=$!; bg+=($m1)
one_line_error "ranks disagree on steps: rank 0 has 2, rank 1 has 3" "$memfit" train "${quick[@]}" --world-size 2 --rank 0 --master 127.0.0.1:$port --steps 2 --dist-timeout 20
wait $m1; [ $? -ne 0 ] && grep -q "ranks disagree on steps" mismatch1.out && ok || bad "rank 1 with different --steps: $(tail -2 mismatch1.out)"
one_line_error "invalid --micro-batch 8: expected 1 to this rank's share of batch (4 of 8 over 2 ranks)" "$memfit" train "${quick[@]}" --world-size 2 --micro-batch 8
one_line_error "invalid --nproc 0" "$memfit" launch --nproc 0 -- train
one_line_error "memfit launch sets --rank itself" "$memfit" launch --nproc 2 -- train --rank 1
one_line_error "memfit launch runs 'train'" "$memfit" launch --nproc 2 -- report

echo "cli distributed: $pass passed, $fail failed"
[ $fail -eq 0 ]
