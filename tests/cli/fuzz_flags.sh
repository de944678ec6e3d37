#!/usr/bin/env bash
# Flag fuzzer: `memfit report|plan|train` on a tiny GPT with one flag replaced by a hostile
# value from the fixed lists below.
#
#   bash tests/cli/fuzz_flags.sh MEMFIT [COUNT|all]
#
# Property of every run: it ends by itself (timeout 60) with exit 0, 1, 2 or 130 (never a
# signal, 124 or 134); a failing run's stderr is exactly one line starting "memfit: " (never
# "memfit: memfit:"); values marked refuse exit non-zero, values marked ok exit 0.
#
# COUNT runs (default 40): the cases marked REFUSE (always run), then the others in an order
# shuffled by MEMFIT_FUZZ_SEED (default 20240601, printed). `all` runs every case (a few
# hundred: about 1 s each). Each run is held to MEMFIT_FUZZ_VMEM_KIB of virtual memory
# (default 4 GiB: a hostile batch must fail, not swallow the machine; 0: no limit, for ASan
# builds, which reserve terabytes of address space).
set -u
memfit=${1:?usage: fuzz_flags.sh MEMFIT [COUNT|all]}
count=${2:-40}
seed=${MEMFIT_FUZZ_SEED:-20240601}
vmem_kib=${MEMFIT_FUZZ_VMEM_KIB:-4194304}
case "$memfit" in /*) ;; *) memfit="$PWD/$memfit" ;; esac
[ -x "$memfit" ] || { echo "cli fuzz flags: $memfit is not an executable"; exit 2; }

# Each case: COMMANDS|FLAG|EXPECT|VALUE|EXTRA
#   COMMANDS  the subcommands that take the flag (r report, p plan, t train); one is drawn per case
#   EXPECT    refuse: must exit non-zero; REFUSE: the same, and run at every COUNT;
#             ok: must exit 0; any: exit 0, 1, 2 or 130 are all fine (the common properties hold)
#   VALUE     passed as --flag=VALUE; _EMPTY_ is ""; @DIR@ is the run's own empty working
#             directory, @FILE@ a regular file in it, @SUB@ an empty directory in it
#   EXTRA     more --flag=value words (no spaces inside one), replacing the base command's;
#             a word prefixed "t:" (or "rp:", ...) only for those subcommands
cases() {
  local ints='0 -1 -0 1.5 1e3 1e308 inf nan abc _EMPTY_ 2147483648 9223372036854775808
18446744073709551616 99999999999999999999 -9223372036854775809'
  # Integer flags: every one of these values is refused (not a positive integer, or past
  # 64 bits); more values per flag below.
  local f v
  for f in batch layers d-model heads seq steps; do
    local cmds=rpt
    [ "$f" = steps ] && cmds=rt
    for v in $ints; do
      [ "$f" = steps ] && [ "$v" = 2147483648 ] && continue  # valid, only long
      echo "$cmds|--$f|refuse|$v|"
    done
  done
  for v in -1 1.5 1e3 inf nan abc _EMPTY_ 2147483648 18446744073709551616 99999999999999999999; do
    echo "rpt|--threads|refuse|$v|"
  done
  for v in 0 -0; do echo "rpt|--threads|ok|$v|"; done
  for v in 0 -1 -0 1.5 inf nan abc _EMPTY_ 2147483648 18446744073709551616 99999999999999999999; do
    echo "rpt|--blocks|refuse|$v|--model=cnn --channels=4"
    echo "rpt|--channels|refuse|$v|--model=cnn --blocks=1"
    echo "rpt|--width|refuse|$v|--model=mlp --layers=1"
  done
  for v in -1 1.5 inf nan abc _EMPTY_ 2147483648 9223372036854775808 18446744073709551616 99999999999999999999; do
    echo "rpt|--micro-batch|refuse|$v|"
  done
  for v in 3 2147483648; do echo "rpt|--micro-batch|refuse|$v|--batch=2"; done
  for v in 0 1; do echo "rpt|--micro-batch|any|$v|t:--budget=256MiB"; done
  for v in -1 1.5 inf nan abc _EMPTY_ 18446744073709551616 99999999999999999999; do
    echo "rpt|--seed|refuse|$v|"
    echo "t|--save-every|refuse|$v|--save=@DIR@/s"
    echo "t|--eval-every|refuse|$v|"
    echo "t|--progress-every|refuse|$v|"
    echo "t|--eval-batches|refuse|$v|--eval-every=1"
  done
  for v in 0 -0; do echo "t|--save-every|refuse|$v|--save=@DIR@/s"; done
  for v in 2147483648 9223372036854775807; do echo "t|--save-every|any|$v|--save=@DIR@/s"; done
  for v in 0 -0; do echo "t|--eval-batches|refuse|$v|--eval-every=1"; done
  echo "t|--eval-batches|REFUSE|0|"
  echo "t|--eval-batches|refuse|-1|"
  for v in 0 2147483648 9223372036854775807; do echo "t|--eval-every|any|$v|"; echo "t|--progress-every|any|$v|"; done
  echo "t|--eval-batches|any|2147483648|"

  # Values that read as something else than written: the 0 of --layers means "the model's
  # default", a leading 0 is octal in CLI11's integer parsing, -1 wraps for an unsigned seed.
  echo "rpt|--layers|REFUSE|0|"
  echo "rpt|--batch|REFUSE|18446744073709551616|"
  for f in batch layers steps seed; do
    for v in 010 0x10 0b11 +2 ' 2' '2 '; do
      local cmds=rpt
      [ "$f" = steps ] && cmds=rt
      echo "$cmds|--$f|any|$v|"
    done
  done

  # Model shapes that are integers but do not fit or do not divide.
  echo "rpt|--heads|refuse|3|"
  echo "rpt|--heads|refuse|64|"
  echo "rpt|--d-model|refuse|33|"
  echo "rpt|--layers|refuse|100000000|"
  echo "rpt|--d-model|refuse|1000000000|"
  echo "rpt|--seq|refuse|100000000|"
  echo "rpt|--seq|refuse|9223372036854775807|"
  echo "rpt|--batch|any|9223372036854775807|"
  echo "rpt|--threads|any|100|"
  echo "rpt|--threads|any|2147483647|"
  echo "rpt|--blocks|refuse|0|"
  echo "rpt|--channels|refuse|0|"
  echo "rpt|--width|refuse|0|"

  # Floating-point flags.
  local floats='inf -inf nan -nan _EMPTY_ abc 1e400 99999999999999999999 18446744073709551616'
  for v in $floats 0 -0 -1 1e-400; do echo "rpt|--lr|refuse|$v|"; done
  echo "rpt|--lr|REFUSE|inf|"
  for v in 1e30 1e308 1e-300 0x1p-3 1.5 0.1; do echo "rpt|--lr|any|$v|"; done
  for v in $floats 1 -0.1 1.5 2; do echo "rpt|--momentum|refuse|$v|--optimizer=sgd"; done
  echo "rpt|--momentum|REFUSE|1|--optimizer=sgd"
  echo "rpt|--momentum|refuse|0.9|--optimizer=adamw"
  echo "rpt|--momentum|refuse|0.9|--optimizer=adagrad"
  echo "rpt|--momentum|ok|0.9|--optimizer=sgd"
  echo "rpt|--momentum|any|0.99|--optimizer=rmsprop"
  for v in $floats -1 -1e-300 1 1e308 2147483648; do echo "rpt|--weight-decay|refuse|$v|"; done
  echo "rpt|--weight-decay|REFUSE|2147483648|"
  for v in 0 0.5 0.999; do echo "rpt|--weight-decay|ok|$v|"; done
  for v in 1 2; do echo "rpt|--weight-decay|ok|$v|--large-weight-decay"; done
  echo "rpt|--momentum|REFUSE|_EMPTY_|--optimizer=sgd"
  echo "pt|--budget|REFUSE|_EMPTY_|"
  for v in $floats 1 -0.1 1.5; do echo "rpt|--dropout|refuse|$v|"; done
  for v in 0 0.99 1e-300; do echo "rpt|--dropout|any|$v|"; done
  for v in $floats 0 -0 -5 86401 1e30 1e308; do echo "t|--dist-timeout|refuse|$v|"; done
  echo "t|--dist-timeout|REFUSE|1e30|"
  for v in 86400 0.001 1e-300; do echo "t|--dist-timeout|any|$v|"; done

  # Sizes.
  for v in 0B 0 -5MiB -1 1e400 inf nan _EMPTY_ abc MiB 10XiB 1e19 99999999999999999999 0.1B 1..5MiB 5MiBB; do
    echo "p|--budget|refuse|$v|"
    echo "t|--budget|refuse|$v|"
  done
  echo "t|--budget|REFUSE|-5MiB|"
  for v in 1TiB 9e18 0x10MiB '5 MiB' 1e9 1.5GiB 800MB; do echo "pt|--budget|any|$v|"; done
  for v in 1 1KiB; do echo "pt|--budget|refuse|$v|"; done

  # Step lists (train --steps 3).
  for v in 0 '3,,' ',3' '1,,2' '1,999999' -1 4 1.0 ' 1' '1 ' abc 99999999999999999999 '1;2' '1-2' +1 ,; do
    echo "t|--inject-oom|refuse|$v|--steps=3"
  done
  echo "t|--inject-oom|REFUSE|1,999999|--steps=3"
  for v in 1 3 '1,1' '3,1' _EMPTY_; do echo "t|--inject-oom|any|$v|--steps=3"; done

  # Checkpoint schedules (the tiny GPT has 4 blocks: 0 to 3).
  for v in every:0 every:-1 every: every:x every:1.5 every:2147483648 every:99999999999999999999 every:1x \
           4 -1 99 2147483648 99999999999999999999 ',1' '1,,2' 0-3 1.5 abc NONE; do
    echo "rpt|--checkpoint|refuse|$v|"
  done
  echo "rpt|--checkpoint|REFUSE|every:0|"
  echo "r|--checkpoint|refuse|auto|"
  for v in all none every:1 every:2 every:2147483647 '0,0' '3,0' '1,' ' 1' +1 _EMPTY_; do
    echo "rpt|--checkpoint|any|$v|t:--budget=256MiB"
  done

  # Words.
  for v in fp8 FP32 _EMPTY_ fp32x 16 half; do echo "rpt|--precision|refuse|$v|"; done
  echo "r|--precision|refuse|auto|"
  echo "r|--precision|refuse|fp16|"
  echo "rpt|--precision|any|bf16|"
  for v in tpu _EMPTY_ CPU cpu:1 meta cuda:-2 'cpu:0x' 'cuda:99999999999' cuda:abc mps xla; do
    echo "rpt|--device|refuse|$v|"
  done
  for v in cuda cuda:0 cuda:1 cpu:0; do echo "rpt|--device|any|$v|"; done
  for v in lamb _EMPTY_ ADAMW 'adamw ' sgd2 lbfgs; do echo "rpt|--optimizer|refuse|$v|"; done
  for v in adam sgd rmsprop adagrad; do echo "rpt|--optimizer|ok|$v|"; done
  for v in int8 _EMPTY_ 8BIT ' 8bit' fp16 4bit; do echo "rpt|--optimizer-state|refuse|$v|"; done
  echo "rpt|--optimizer-state|refuse|8bit|--optimizer=sgd"
  echo "r|--optimizer-state|refuse|auto|"
  for v in fp32 8bit; do echo "rpt|--optimizer-state|ok|$v|"; done
  for v in 1,1 0.9 0.9,0.999,0.5 nan,0.9 0.9,nan -0.1,0.9 0.9,1 '0.9;0.999' _EMPTY_ ',' 'inf,0.9' 'abc' \
           '0.9,0.999x' 1e400,0.9; do
    echo "rpt|--betas|refuse|$v|"
  done
  echo "rpt|--betas|refuse|0.5,0.5|--optimizer=sgd"
  for v in '0.9,0.999' '0,0' ' 0.9,0.999'; do echo "rpt|--betas|any|$v|"; done
  for v in rnn _EMPTY_ GPT 'gpt '; do echo "rpt|--model|refuse|$v|"; done
  for v in /nonexistent/text.txt /dev/null @DIR@ @SUB@ /proc/self/mem; do echo "rpt|--data|refuse|$v|"; done
  echo "rpt|--data|refuse|@FILE@|"
  echo "rpt|--data|any|_EMPTY_|"

  # Distributed flags of a single-process run, and the ranks.
  for v in junk _EMPTY_ :29500 host:0 host:65536 'host:29500x'; do
    echo "t|--master|refuse|$v|"
  done
  for v in 0 -1 -0 1.5 abc _EMPTY_ 2147483648 18446744073709551616; do
    echo "t|--world-size|refuse|$v|"
  done
  for v in -1 1.5 abc _EMPTY_ 2147483648 18446744073709551616; do echo "t|--rank|refuse|$v|--world-size=1"; done
  for v in 0 -0; do echo "t|--rank|ok|$v|--world-size=1"; done
  echo "t|--rank|refuse|1|"
  echo "t|--world-size|refuse|3|--batch=2"
  for v in 4 -1 1.5 abc _EMPTY_ 2147483648 18446744073709551616; do
    echo "t|--zero|refuse|$v|"
    echo "r|--zero|refuse|$v|--world-size=2"
  done
  echo "t|--zero|REFUSE|4|"
  echo "t|--zero|ok|3|"  # (one process: nothing to shard)
  for v in 0 3 -1 _EMPTY_ 2147483648; do echo "r|--world-size|refuse|$v|--batch=2"; done

  # Paths: where output cannot be written, or state cannot be read. Outputs only ever go under
  # the run's own directory: memfit writes a temporary and renames it over the target, which
  # as root replaces even a device such as /dev/full.
  for v in @FILE@/x @FILE@ _EMPTY_; do echo "t|--save|refuse|$v|"; done
  for v in /nonexistent/state @SUB@ @FILE@ /dev/null @FILE@/x; do echo "t|--resume|refuse|$v|"; done
  echo "t|--resume|any|_EMPTY_|"
  for v in @FILE@/x.jsonl @SUB@ @DIR@/missing/log.jsonl; do echo "t|--json-log|refuse|$v|"; done
  for v in @FILE@/x.html @SUB@ @DIR@/missing/r.html; do
    echo "t|--report|refuse|$v|"
    echo "r|--html|refuse|$v|"
  done
  echo "t|--report|any|_EMPTY_|"
}

# A seeded 64-bit LCG (bash arithmetic wraps): the same cases in the same order for a seed.
rng=$seed
next_random() { rng=$(( rng * 6364136223846793005 + 1442695040888963407 )); echo $(( (rng >> 33) & 0x7fffffff )); }

mapfile -t all_cases < <(cases)
priority=(); others=()
for c in "${all_cases[@]}"; do
  IFS='|' read -r _ _ expect _ _ <<<"$c"
  if [ "$expect" = REFUSE ]; then priority+=("$c"); else others+=("$c"); fi
done
# Fisher-Yates over the others.
for (( i=${#others[@]}-1; i>0; i-- )); do
  j=$(( $(next_random) % (i + 1) ))
  t=${others[i]}; others[i]=${others[j]}; others[j]=$t
done
chosen=("${priority[@]}" "${others[@]}")
if [ "$count" != all ]; then
  [[ "$count" =~ ^[0-9]+$ ]] || { echo "cli fuzz flags: COUNT must be a number or all, not '$count'"; exit 2; }
  [ "$count" -lt "${#priority[@]}" ] && count=${#priority[@]}
  chosen=("${chosen[@]:0:$count}")
fi
echo "cli fuzz flags: ${#chosen[@]} of ${#all_cases[@]} cases, seed $seed (MEMFIT_FUZZ_SEED), memfit $memfit"

work=$(mktemp -d "${TMPDIR:-/tmp}/memfit-fuzz-flags.XXXXXX")
trap 'rm -rf "$work"' EXIT
tiny=(--layers=1 --d-model=32 --heads=2 --seq=16 --batch=2 --threads=1)

# Replaces --NAME=... in the array named by $1 with the word $2 (--NAME=VALUE), or appends it.
set_flag() {
  local -n _arr=$1
  local word=$2 name=${2%%=*} k
  for k in "${!_arr[@]}"; do
    if [ "${_arr[k]%%=*}" = "$name" ]; then _arr[k]=$word; return; fi
  done
  _arr+=("$word")
}

pass=0; fail=0; n=0
for c in "${chosen[@]}"; do
  n=$((n + 1))
  IFS='|' read -r cmds flag expect value extra <<<"$c"
  cmd_letter=${cmds:$(( $(next_random) % ${#cmds} )):1}
  dir="$work/case$n"; mkdir -p "$dir/sub"; echo "not a state" >"$dir/file"
  case $cmd_letter in
    r) args=(report "${tiny[@]}" --steps=1) ;;
    p) args=(plan "${tiny[@]}" --budget=64MiB --no-verify) ;;
    t) args=(train "${tiny[@]}" --steps=1 --no-progress "--report=$dir/report.html") ;;
  esac
  [ "$value" = _EMPTY_ ] && value=""
  value=${value//@DIR@/$dir}; value=${value//@FILE@/$dir/file}; value=${value//@SUB@/$dir/sub}
  for word in ${extra//@DIR@/$dir}; do
    if [[ "$word" =~ ^([rpt]+):(.*)$ ]]; then
      [[ "${BASH_REMATCH[1]}" == *"$cmd_letter"* ]] || continue
      word=${BASH_REMATCH[2]}
    fi
    set_flag args "$word"
  done
  set_flag args "$flag=$value"
  err=$( cd "$dir" && { [ "$vmem_kib" = 0 ] || ulimit -v "$vmem_kib"; } && timeout 60 "$memfit" "${args[@]}" 2>&1 >/dev/null ); rc=$?
  lines=$(printf '%s' "$err" | grep -c '')
  why=""
  case $rc in
    0|1|2|130) ;;
    124) why="timed out (60 s)" ;;
    126|127) why="exit $rc: could not run $memfit" ;;
    *) if [ $rc -gt 128 ]; then why="killed by signal $((rc - 128))"; else why="exit $rc"; fi ;;
  esac
  if [ -z "$why" ] && [ $rc -ne 0 ]; then
    if [ "$lines" -ne 1 ]; then why="stderr has $lines lines, expected one"
    elif [[ "$err" != "memfit: "* ]]; then why="stderr does not start with 'memfit: '"
    elif [[ "$err" == "memfit: memfit:"* ]]; then why="stderr says 'memfit: memfit:'"
    fi
  fi
  if [ -z "$why" ]; then
    case $expect in
      refuse|REFUSE) [ $rc -eq 0 ] && why="accepted a value that must be refused" ;;
      ok) [ $rc -ne 0 ] && why="refused a valid value" ;;
    esac
  fi
  if [ -z "$why" ]; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    printf 'FAILED (%s): memfit' "$why"; printf " %q" "${args[@]}"; printf ' -> rc=%s, stderr: %s\n' "$rc" "$(printf '%s' "$err" | head -3)"
  fi
  rm -rf "$dir"
done
echo "cli fuzz flags: $pass passed, $fail failed"
[ $fail -eq 0 ]
