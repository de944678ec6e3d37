#!/usr/bin/env bash
# Tracker overhead in instructions, not seconds: valgrind's callgrind counts the instructions
# of training steps of a GPT with and without memfit's MemoryTracker installed. The count
# repeats exactly for the same binary and inputs, whatever else the machine runs, so a 2% goal
# can be checked where timing noise is larger than 2%.
#
#   bash bench/harness/tracker_instructions.sh [--build DIR] [-- tracker_overhead flags]
#
# The steps' own instructions are isolated by difference: a run of 1 + N steps minus a run of
# 1 + 0 steps (model building, data, the warm-up step and exit cancel out), with and without
# the tracker; one thread (callgrind runs threads one at a time anyway).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$here/../.." && pwd)/build
command="bash bench/harness/tracker_instructions.sh"
(($#)) && command+=$(printf ' %q' "$@")
if [[ ${1:-} == --build ]]; then build=$2; shift 2; fi
[[ ${1:-} == -- ]] && shift
model=("$@")
((${#model[@]})) || model=(--layers 2 --d-model 128 --seq 64 --batch 8)
bin=$build/bench/tracker_overhead
[[ -x $bin ]] || { echo "tracker_instructions: $bin not found (cmake -S . -B $build -DMEMFIT_BUILD_BENCH=ON && cmake --build $build --target tracker_overhead)" >&2; exit 1; }
command -v valgrind >/dev/null || { echo "tracker_instructions: valgrind not found" >&2; exit 1; }
steps=3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# instructions TRACKED STEPS: callgrind's total instruction count (Ir) of one run.
instructions() {
  valgrind --tool=callgrind --callgrind-out-file="$dir/out" "$bin" "${model[@]}" --threads 1 \
    --tracked "$1" --steps "$2" > "$dir/log" 2>&1 || { cat "$dir/log" >&2; exit 1; }
  sed -n 's/^summary: //p' "$dir/out"
}
echo "command: $command"
echo "model flags: ${model[*]}; $steps steps after a warm-up step, 1 thread"
declare -A ir
for tracked in 0 1; do
  for n in 0 $steps; do
    ir[$tracked.$n]=$(instructions "$tracked" "$n")
    echo "tracked=$tracked steps=1+$n: ${ir[$tracked.$n]} instructions"
  done
done
without=$(( (ir[0.$steps] - ir[0.0]) / steps ))
with=$(( (ir[1.$steps] - ir[1.0]) / steps ))
echo "per step: $without instructions without the tracker, $with with it"
awk -v a="$without" -v b="$with" 'BEGIN { printf "tracker overhead: %+.3f%% of a step'"'"'s instructions\n", 100 * (b - a) / a }'
