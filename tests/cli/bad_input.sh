#!/usr/bin/env bash
# Bad input: one line on stderr naming the value, a non-zero exit, nothing on stdout.
set -u
memfit=$1
pass=0; fail=0
errfile=$(mktemp)
trap 'rm -f "$errfile"' EXIT
check() {  # check "<args>" "<text expected in the error line>"
  local out err rc
  out=$("$memfit" $1 2>"$errfile"); rc=$?  # (one run: each loads LibTorch, about a second)
  err=$(cat "$errfile")
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
# CPU autocast runs fp16 from LibTorch 2.2 on (memfit --version names the LibTorch).
if [[ $("$memfit" --version) =~ LibTorch\ 1\. ]]; then check "report --precision fp16" "fp16"; fi
check "report --precision fp8" "fp8"
check "report --checkpoint 99 --layers 2" "block 99"
check "report --checkpoint every:0" "every:0"
check "report --no-such-flag" "no-such-flag"
check "report --steps 0" "--steps 0"
# Findings of the fuzzed flags (issue 14): each refused before any work, in one line.
check "report --steps 99999999999999999999" "--steps 99999999999999999999: out of the range"
check "report --layers 0" "--layers 0"
check "report --layers 2147483648" "does not fit this machine"
check "report --blocks 4294967296 --model cnn" "does not fit this machine"
check "train --lr inf --steps 1" "--lr inf"
check "train --lr 0 --steps 1" "--lr 0"
check "train --eval-batches 0 --steps 1" "--eval-batches 0"
check "train --eval-batches -1 --steps 1" "--eval-batches -1"
check "train --inject-oom 5 --steps 2" "--inject-oom"
check "train --dist-timeout 1e30 --world-size 2 --steps 1" "--dist-timeout"
check "train --offload cpu --steps 1" "--offload cpu"
check "plan --budget 1GiB --offload gpu" "--offload gpu"
check "train --host-budget 2gigs --offload optimizer --steps 1" "--host-budget"
check "train --offload optimizer --world-size 2 --zero 3 --master 127.0.0.1:1 --steps 1" "--offload optimizer"
check "train --optimizer lamb" "--optimizer 'lamb'"
# Integers are decimal: CLI11 alone would read 010 as octal 8 and 0x10 as 16.
check "report --batch 010" "'010': expected a decimal integer"
check "report --batch 0x10" "'0x10': expected a decimal integer"
check "train --steps 0b11" "'0b11': expected a decimal integer"
check "train --optimizer adam --momentum 0.9" "--momentum 0.9"
check "report --device tpu" "--device 'tpu'"
check "train --optimizer-state int8 --steps 1" "--optimizer-state 'int8'"
check "train --optimizer sgd --optimizer-state 8bit --steps 1" "--optimizer-state '8bit'"
check "report --optimizer-state auto" "--optimizer-state 'auto'"
# Issue 29: empty values of number and size flags, weight decay outside [0, 1) unless asked.
check_argv() {  # check_argv "<text expected in the error line>" args... (each word as given, '' too)
  local expect=$1; shift
  local err rc out; out=$("$memfit" "$@" 2>"$errfile"); rc=$?
  err=$(cat "$errfile")
  local lines; lines=$(printf '%s' "$err" | grep -c '')
  if [ $rc -ne 0 ] && [ "$lines" -eq 1 ] && [[ "$err" == *"$expect"* ]] && [ -z "$out" ]; then
    pass=$((pass+1))
  else
    fail=$((fail+1)); echo "FAILED: memfit $* -> rc=$rc lines=$lines stderr: $err"
  fi
}
check_argv "--momentum: '': expected a number" report --optimizer sgd --momentum ''
check_argv "--lr: '': expected a number" train --lr '' --steps 1
check_argv "--budget: '': expected a size" plan --budget ''
check_argv "--budget: '': expected a size" train --budget '' --steps 1
check_argv "--weight-decay 2147483648: expected 0 <= weight decay < 1 (--large-weight-decay" report --weight-decay 2147483648
check_argv "--weight-decay 1: expected 0 <= weight decay < 1" train --weight-decay 1 --steps 1
if "$memfit" report --layers 1 --d-model 32 --heads 2 --seq 16 --batch 2 --steps 1 --optimizer sgd --weight-decay 2 \
     --large-weight-decay >/dev/null 2>&1; then pass=$((pass+1)); else fail=$((fail+1)); echo "FAILED: --large-weight-decay refused"; fi
# A file's bytes are never echoed raw: a corrupt state.json's parser error, printable and short.
state=$(mktemp -d)
printf '{"a": \xff\xfe\x01\x1b[31m garbage' > "$state/state.json"
err=$("$memfit" train --resume "$state" --steps 1 2>&1 >/dev/null); rc=$?
rm -rf "$state"
if [ $rc -ne 0 ] && [ "$(printf '%s' "$err" | grep -c '')" -eq 1 ] && printf '%s' "$err" | LC_ALL=C grep -q '\\xFF' \
   && ! printf '%s' "$err" | LC_ALL=C grep -qP '[\x00-\x08\x0b-\x1f\x7f-\xff]'; then
  pass=$((pass+1))
else
  fail=$((fail+1)); echo "FAILED: corrupt state.json -> rc=$rc stderr: $(printf '%s' "$err" | od -c | head -3)"
fi
echo "cli bad input: $pass passed, $fail failed"
[ $fail -eq 0 ]
