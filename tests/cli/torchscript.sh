#!/usr/bin/env bash
# The user's own model from Python: TorchScript files and torch.save data made here by
# Debian's python3-torch (tests/torchscript/export_models.py), measured, planned, trained under
# a budget, resumed, and handed back as a TorchScript file Python loads.
set -u
memfit=$(realpath "$1")
exporter=$(realpath "$2")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
pass=0; fail=0
ok() { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAILED: $*"; }
py() { "${MEMFIT_TEST_PYTHON:-/usr/bin/python3}" - "$@"; }
"${MEMFIT_TEST_PYTHON:-/usr/bin/python3}" "$exporter" . || { echo "FAILED: export_models.py"; exit 1; }
gpt=(--model gpt.pt --data gpt_data.pt --batch 16)
cnn=(--model cnn.pt --data cnn_data.pt --batch 16)
quiet=(--no-progress --report "")

# 1. report: the weights category is the module's parameter bytes exactly; blocks by child.
"$memfit" report "${gpt[@]}" --json > gpt_report.json 2> err.txt || bad "report: $(cat err.txt)"
py gpt_report.json gpt.pt <<'PY' && ok || bad "report of the TorchScript GPT"
import json, sys, torch
j = json.load(open(sys.argv[1])); m = torch.jit.load(sys.argv[2])
params = sum(p.numel() * p.element_size() for p in m.parameters())
assert j["parameter_bytes"] == params and j["states"]["weights"] == params and j["at_peak"]["weights"] == params, (j["states"], params)
names = [b["name"] for b in j["blocks"]]
assert names == ["0:Embed", "1:Block", "2:Block", "3:Block", "4:Head"], names
assert all(b["activation_bytes"] > 0 for b in j["blocks"])
PY

# 1b. buffers (BatchNorm's running statistics) are their own category, exactly their bytes,
#     and the categories still add up to the peak.
"$memfit" report "${cnn[@]}" --json > cnn_report.json 2> err.txt || bad "report cnn: $(cat err.txt)"
py cnn_report.json cnn.pt <<'PY' && ok || bad "buffers category of the TorchScript CNN"
import json, sys, torch
j = json.load(open(sys.argv[1])); m = torch.jit.load(sys.argv[2])
buffers = sum(b.numel() * b.element_size() for b in m.buffers())
assert buffers > 0
assert j["states"]["buffers"] == buffers and j["at_peak"]["buffers"] == buffers, (j["states"], buffers)
p = j["at_peak"]
assert sum(p[k] for k in ("weights", "buffers", "gradients", "optimizer_state", "activations", "other")) == j["peak_bytes"]
PY

# 2. plan at 80/60/45% of the plain peak: measured <= budget, prediction within 5%.
for model in gpt cnn; do
  args=(--model $model.pt --data ${model}_data.pt --batch 16)
  "$memfit" report "${args[@]}" --json > plain.json 2>/dev/null
  plain=$(py plain.json <<'PY'
import json, sys; print(json.load(open(sys.argv[1]))["peak_bytes"])
PY
)
  for pct in 80 60 45; do
    "$memfit" plan "${args[@]}" --precision fp32 --budget $((plain * pct / 100)) --json > plan.json 2> err.txt
    py plan.json $pct $model <<'PY' && ok || bad "plan $model at $pct%: $(cat err.txt)"
import json, sys
j = json.load(open(sys.argv[1]))
if not j["feasible"]:
    assert j["floor_bytes"] > j["budget_bytes"], j; sys.exit(0)
m, p = j["measured"]["peak_bytes"], j["predicted"]["peak_bytes"]
assert m <= j["budget_bytes"], (sys.argv[2:], m, j["budget_bytes"])
assert abs(p - m) <= 0.05 * m, (sys.argv[2:], p, m)
PY
  done
done

# 3. train: the loss falls; injected OOMs lose nothing; resume is exact; model.pt is the trained model.
pinned=(--micro-batch 8 --checkpoint none --precision fp32 --budget 64MiB --optimizer-state fp32)
"$memfit" train "${gpt[@]}" "${quiet[@]}" --steps 30 --json-log t.jsonl > t.out 2>&1 || bad "train: $(tail -2 t.out)"
py t.jsonl <<'PY' && ok || bad "the loss does not fall"
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l and json.loads(l)["type"] == "step"]
assert steps[-1]["loss"] < 0.8 * steps[0]["loss"], (steps[0]["loss"], steps[-1]["loss"])
PY
"$memfit" train "${gpt[@]}" "${quiet[@]}" "${pinned[@]}" --steps 6 --json-log a.jsonl --save full --dump-weights w.bin > a.out 2>&1 || bad "straight run"
"$memfit" train "${gpt[@]}" "${quiet[@]}" "${pinned[@]}" --steps 6 --json-log b.jsonl --inject-oom 2,5 > b.out 2>&1 || bad "injected run"
"$memfit" train "${gpt[@]}" "${quiet[@]}" "${pinned[@]}" --steps 3 --save half > h.out 2>&1 || bad "first half"
"$memfit" train "${gpt[@]}" "${quiet[@]}" "${pinned[@]}" --steps 6 --resume half --json-log c.jsonl > c.out 2>&1 || bad "resume: $(tail -2 c.out)"
py a.jsonl b.jsonl c.jsonl <<'PY' && ok || bad "injected OOMs or resume changed the weights"
import json, sys
a, b, c = ([json.loads(l) for l in open(p)][-1] for p in sys.argv[1:])
assert b["oom_recoveries"] == 2 and a["samples"] == b["samples"], b
assert a["weights_sha256"] == b["weights_sha256"] == c["weights_sha256"], (a["weights_sha256"], b["weights_sha256"], c["weights_sha256"])
PY
py full/model.pt gpt.pt w.bin probe.pt <<'PY' && ok || bad "model.pt is not the trained model"
import sys, torch
trained, original = torch.jit.load(sys.argv[1]), torch.jit.load(sys.argv[2])
flat = torch.frombuffer(bytearray(open(sys.argv[3], "rb").read()), dtype=torch.float32)
at = 0
with torch.no_grad():
    for p in original.parameters():  # memfit's last weights, in the module's order
        p.copy_(flat[at:at + p.numel()].view_as(p)); at += p.numel()
assert at == flat.numel(), (at, flat.numel())
x = torch.load(sys.argv[4])["inputs"]
trained.eval(); original.eval()
diff = (trained(x) - original(x)).abs().max().item()
print(f"  model.pt vs memfit's last weights: max abs output difference {diff:.3g}")
assert diff <= 1e-6, diff
PY

# ZeRO 2 over 2 ranks (memfit launch) trains the same weights as one process.
"$memfit" launch --nproc 2 -- train "${gpt[@]}" "${quiet[@]}" "${pinned[@]}" --steps 6 --zero 2 --dump-weights z.bin > z.out 2>&1 \
  || bad "ZeRO 2 run: $(tail -3 z.out)"
py w.bin z.bin <<'PY' && ok || bad "ZeRO 2 weights differ from one process"
import array, math, sys
a, b = (array.array("f", open(p, "rb").read()) for p in sys.argv[1:])
assert len(a) == len(b) > 0
rel = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))) / math.sqrt(sum(x * x for x in a))
assert rel <= 1e-5, rel
PY

# 4. A module that is not a Sequential runs as one block, with the note; --loss model works.
"$memfit" train --model plain.pt --data gpt_data.pt --batch 16 "${quiet[@]}" --steps 3 > p.out 2>&1 \
  && grep -q "note: the model runs as one block: recomputation needs it exported as an nn.Sequential" p.out && ok \
  || bad "non-Sequential module: $(tail -3 p.out)"
"$memfit" train --model lossy.pt --data gpt_data.pt --loss model --batch 16 "${quiet[@]}" --steps 3 > l.out 2>&1 && ok \
  || bad "--loss model: $(tail -3 l.out)"

# 5. Blocks whose first op writes into their input (ReLU/SiLU(inplace=True), x.add_): plans at
#    60/45/30% hold and are predicted within 5%; training recomputing every block gives the
#    weights of training recomputing none, bit for bit.
inplace=(--model inplace.pt --data inplace_data.pt --batch 32)
"$memfit" plan "${inplace[@]}" --precision fp32 --micro-batch 32 --checkpoint none --budget 1TiB --json > plain.json 2> err.txt \
  || bad "plain plan of the in-place CNN: $(cat err.txt)"
plain=$(py plain.json <<'PY'
import json, sys; print(json.load(open(sys.argv[1]))["measured"]["peak_bytes"])
PY
)
for pct in 60 45 30; do
  "$memfit" plan "${inplace[@]}" --precision fp32 --budget $((plain * pct / 100)) --json > plan.json 2> err.txt
  py plan.json $pct <<'PY' && ok || bad "plan of the in-place CNN at $pct%: $(cat err.txt)"
import json, sys
j = json.load(open(sys.argv[1]))
if not j["feasible"]:
    assert j["floor_bytes"] > j["budget_bytes"], j; sys.exit(0)
m, p = j["measured"]["peak_bytes"], j["predicted"]["peak_bytes"]
assert m <= j["budget_bytes"], (sys.argv[2:], m, j["budget_bytes"])
assert abs(p - m) <= 0.05 * m, (sys.argv[2:], p, m)
PY
done
for ck in none all 2,4,5; do
  "$memfit" train "${inplace[@]}" "${quiet[@]}" --precision fp32 --micro-batch 16 --checkpoint $ck --budget 1GiB \
    --steps 3 --json-log "inplace_$ck.jsonl" > t.out 2>&1 || bad "train the in-place CNN, recompute $ck: $(tail -2 t.out)"
done
py inplace_none.jsonl inplace_all.jsonl inplace_2,4,5.jsonl <<'PY' && ok || bad "recomputing blocks that write into their input changed the weights"
import json, sys
sums = [[json.loads(l) for l in open(p)][-1]["weights_sha256"] for p in sys.argv[1:]]
assert len(set(sums)) == 1, sums
PY

# 5b. An error inside a block: one line naming the block, what ran, and the innermost cause.
one_line() {  # expected-text, command...
  local expect=$1; shift
  local err rc; err=$("$@" 2>&1 >/dev/null); rc=$?
  local n; n=$(printf '%s' "$err" | grep -c '')
  if [ $rc -ne 0 ] && [ "$n" -eq 1 ] && [[ "$err" == *"$expect"* ]]; then ok; else bad "$* -> rc=$rc lines=$n: $err"; fi
}
one_line "memfit: block 1 (Boom), forward: boom: more than one sample" "$memfit" report --model boom.pt --data boom_data.pt --batch 4
one_line "memfit: block 1 (Boom), forward: boom: more than one sample" "$memfit" plan --model boom.pt --data boom_data.pt --batch 4 \
  --budget 1GiB --profile-cache none

# 6. Bad input: one line, a non-zero exit, nothing written.
one_line_error() {  # expected-text, command...
  local expect=$1; shift
  local err rc; err=$("$@" 2>&1 >/dev/null); rc=$?
  local n; n=$(printf '%s' "$err" | grep -c '')
  if [ $rc -ne 0 ] && [ "$n" -eq 1 ] && [[ "$err" == *"$expect"* ]]; then ok; else bad "$* -> rc=$rc lines=$n: $err"; fi
}
echo "not torchscript" > junk.pt
py <<'PY'
import torch
torch.save({"inputs": torch.zeros(10, 32, dtype=torch.long)}, "no_targets.pt")
torch.save({"inputs": torch.zeros(10, 32, dtype=torch.long), "targets": torch.zeros(9, 32, dtype=torch.long)}, "uneven.pt")
torch.save({"inputs": torch.zeros(10, 7), "targets": torch.zeros(10, dtype=torch.long)}, "wrong_shape.pt")
torch.save({"inputs": torch.zeros(10, 32, dtype=torch.long), "targets": torch.zeros(10, 5, dtype=torch.long)}, "wrong_targets.pt")
PY
one_line_error "expected a TorchScript file" "$memfit" train --model junk.pt --data gpt_data.pt --save s1
one_line_error "expected a file written by torch.save" "$memfit" train --model gpt.pt --data no_targets.pt --save s2
one_line_error "same number of samples" "$memfit" train --model gpt.pt --data uneven.pt --save s3
one_line_error "forward fails on inputs of shape [1, 7] Float" "$memfit" train --model gpt.pt --data wrong_shape.pt --save s4
one_line_error "for output [1, 32, 48] Float and targets [1, 5] Long" "$memfit" train --model gpt.pt --data wrong_targets.pt --save s5
[ ! -e s1 ] && [ ! -e s2 ] && [ ! -e s3 ] && [ ! -e s4 ] && [ ! -e s5 ] && ok || bad "a refused run wrote files: $(ls -d s* 2>/dev/null)"

echo "cli torchscript: $pass passed, $fail failed"
[ $fail -eq 0 ]
