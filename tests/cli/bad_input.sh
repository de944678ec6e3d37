#!/usr/bin/env bash
# Bad input: one line on stderr naming the value, a non-zero exit, nothing on stdout.
set -u
memfit=$1
pass=0; fail=0
check() {  # check "<args>" "<text expected in the error line>"
  local out err rc
  err=$("$memfit" $1 2>&1 >/dev/null); rc=$?
  out=$("$memfit" $1 2>/dev/null)
  local lines; lines=$(printf '%s' "$err" | grep -c '')
  if [ $rc -ne 0 ] && [ "$lines" -eq 1 ] && [[ "$err" == *"$2"* ]] && [ -z "$out" ]; then
    pass=$((pass+1))
  else
    fail=$((fail+1)); echo "FAILED: memfit $1 -> rc=$rc lines=$lines stderr: $err"
  fi
}
check "report --model rnn" "--model 'rnn'"
check "report --batch 0" "--batch 0"
check "report --d-model 64 --heads 5" "--heads 5"
check "report --layers -1" "--layers -1"
check "report --data /nonexistent/x.txt" "/nonexistent/x.txt"
check "report --micro-batch 32 --batch 16" "--micro-batch 32"
check "report --precision fp16" "fp16"
check "report --precision fp8" "fp8"
check "report --checkpoint 99 --layers 2" "block 99"
check "report --checkpoint every:0" "every:0"
check "report --no-such-flag" "no-such-flag"
check "report --steps 0" "--steps 0"
echo "cli bad input: $pass passed, $fail failed"
[ $fail -eq 0 ]
