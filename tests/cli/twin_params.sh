#!/usr/bin/env bash
# memfit's C++ models and their PyTorch twins (bench/harness/pytorch_twin.py) have equal parameter
# counts: GPT defaults, a small GPT, the CNN defaults. The side-by-side benchmark compares
# like with like only if this holds.
#   bash tests/cli/twin_params.sh MEMFIT bench/harness/pytorch_twin.py
set -u
memfit=$1
twin=$2
py=${MEMFIT_TEST_PYTHON:-/usr/bin/python3}   # Debian's interpreter (python3-torch), or the LibTorch build's own PyTorch
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
  echo "twin params: FAILED: $py cannot import torch (python3-torch missing; scripts/setup.sh installs it)"
  exit 1
fi
pass=0; fail=0
check() {  # check "<model flags, the same on both sides>"
  local ours theirs
  # One step of batch 1 on one thread: the count does not depend on the batch, the step is cheap.
  ours=$("$memfit" report $1 --batch 1 --steps 1 --threads 1 --json 2>&1 |
         "$py" -c 'import json, sys; print(json.load(sys.stdin)["parameters"])' 2>/dev/null)
  theirs=$("$py" "$twin" $1 --params-only 2>&1)
  if [[ "$ours" =~ ^[0-9]+$ ]] && [ "$ours" == "$theirs" ]; then
    pass=$((pass+1))
  else
    fail=$((fail+1)); echo "FAILED: $1: memfit ${ours:-(no count)}, PyTorch twin ${theirs:-(no count)}"
  fi
}
check "--model gpt"
check "--model gpt --layers 2 --d-model 64 --heads 8 --seq 32"
check "--model cnn"
echo "twin params: $pass passed, $fail failed"
[ $fail -eq 0 ]
