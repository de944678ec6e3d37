#!/usr/bin/env bash
# The GPU check: on a machine with CUDA and PyTorch 2.x, builds memfit against that PyTorch's
# LibTorch, runs the test suite (ctest) in that CUDA build, reads CUDA's allocated vs reserved
# bytes through memfit (`memfit report --json`, device_memory.cuda) and verifies a plan under a
# budget (`memfit plan`, which runs real steps). Within 8 minutes in all; everything goes to
# one results file.
#
#   bash bench/gpu_check.sh [RESULTS_FILE]          # default: gpu_check.txt
#
#   PYTHON=...                 the interpreter with PyTorch (default: the first of python3 and
#                              /usr/bin/python3 that imports torch)
#   GPU_CHECK_BUILD_DIR=DIR    build there (default: build-gpu-check); a directory that is
#                              already configured is reused as it is (no second full build)
#   GPU_CHECK_JOBS=N           compile jobs (default: all cores)
#   GPU_CHECK_SECONDS=S        the whole check's time limit (default 480)
#
# Without CUDA (no nvidia-smi, no torch, or torch.cuda.is_available() false) it still runs its
# CPU parts (configure, build the CLI, the plan check), then says so in one line starting
# "gpu_check: NO CUDA" and exits 3: a machine without a GPU never passes for a GPU check.
# PyTorch wheels built with the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0) may not link with
# Debian's libfmt/gtest; the build step then fails and says so here.
# It builds the way scripts/test-torch2.sh does (the torch package folder and its share/cmake on
# the prefix path, nvcc on PATH, no benchmarks), so that the GPU machine only adds running the
# CUDA parts: the suite in the CUDA build, the caching allocator's counters as memfit reads them,
# and a plan verified on the GPU (`--device cuda`).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
results=$(realpath -m "${1:-gpu_check.txt}")
build=$(realpath -m "${GPU_CHECK_BUILD_DIR:-$root/build-gpu-check}")
jobs=${GPU_CHECK_JOBS:-$(nproc)}
deadline=$(($(date +%s) + ${GPU_CHECK_SECONDS:-480}))
: > "$results"
log() { echo "$*" | tee -a "$results"; }
left() { local s=$((deadline - $(date +%s))); echo $((s > 0 ? s : 1)); }
# run LABEL CMD...: the command's output into the results file, within the time left.
run() {
  local label=$1; shift
  log "== $label: $*"
  timeout "$(left)" "$@" >> "$results" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && log "-- $label: TIMED OUT (the check's ${GPU_CHECK_SECONDS:-480} s ran out)" || log "-- $label: exit $rc"
  return $rc
}
fail() { log "gpu_check: FAILED: $*"; exit 1; }

log "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, memfit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"

# 1. Is there a GPU, and a PyTorch that sees it?
no_cuda=""
if command -v nvidia-smi > /dev/null; then
  run "nvidia-smi" nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
else
  no_cuda="nvidia-smi not found"
fi
py=${PYTHON:-}
if [ -z "$py" ]; then
  for c in python3 /usr/bin/python3; do
    if "$c" -c 'import torch' > /dev/null 2>&1; then py=$c; break; fi
  done
fi
prefix=""
if [ -z "$py" ] || ! "$py" -c 'import torch' > /dev/null 2>&1; then
  no_cuda=${no_cuda:-"no python3 that imports torch (set PYTHON)"}
else
  info=$("$py" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)
  log "torch (via $py): version, CUDA, cuda available = $info"
  [[ $info == *" True" ]] || no_cuda=${no_cuda:-"torch.cuda.is_available() is False ($py: torch $info)"}
  torch_dir=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)
  # Debian's python3-torch ships no CMake files: the system libtorch-dev is found instead.
  # The folder itself first, so that its lib/ wins over a system LibTorch in /usr/lib.
  [ -n "$torch_dir" ] && [ -d "$torch_dir/share/cmake/Torch" ] && prefix="$torch_dir;$torch_dir/share/cmake"
fi
for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
  [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
done
[ -n "$no_cuda" ] && log "no CUDA: $no_cuda (the CPU parts run anyway)"

# 2. Configure and build (against the PyTorch found, when it ships LibTorch's CMake files).
if [ -f "$build/CMakeCache.txt" ]; then
  log "reusing the configured build directory $build (Torch_DIR $(grep -m1 '^Torch_DIR' "$build/CMakeCache.txt" | cut -d= -f2))"
  run "configure" cmake -S "$root" -B "$build" || fail "configure failed (see $results)"
else
  run "configure" cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMEMFIT_BUILD_BENCH=OFF \
    ${prefix:+"-DCMAKE_PREFIX_PATH=$prefix"} \
    || fail "configure failed (see $results)"
fi
# Without CUDA only the CLI is needed; with it, everything ctest runs.
if [ -n "$no_cuda" ]; then targets=(--target memfit_cli); else targets=(); fi
run "build" cmake --build "$build" -j"$jobs" "${targets[@]}" || fail "build failed (see $results)"
memfit=$build/memfit

# 3. CPU: a plan on a tiny GPT, verified by real steps under 60% of its plain peak.
tiny=(--layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 --threads 2)
report=$(timeout "$(left)" "$memfit" report "${tiny[@]}" --steps 2 --json 2>> "$results") || fail "memfit report failed"
peak=$(echo "$report" | "${py:-/usr/bin/python3}" -c 'import json, sys; print(json.load(sys.stdin)["peak_bytes"])') \
  || fail "memfit report --json gave no peak_bytes"
log "tiny GPT plain step: $peak bytes; device_memory: $(echo "$report" | "${py:-/usr/bin/python3}" -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["device_memory"]))')"
budget=$((peak * 60 / 100))
plan=$(timeout "$(left)" "$memfit" plan "${tiny[@]}" --budget "$budget" --json 2>> "$results") || fail "memfit plan failed"
echo "$plan" >> "$results"
echo "$plan" | "${py:-/usr/bin/python3}" -c '
import json, sys
j = json.load(sys.stdin)
b = j["budget_bytes"]
assert j["feasible"], "no plan for %d bytes" % b
m = j["measured"]["peak_bytes"]
assert 0 < m <= b, "measured peak %d over the budget %d" % (m, b)
print("plan check: %s, measured peak %d <= budget %d" % (j["plan"], m, b))' >> "$results" 2>&1 \
  || fail "the verified plan did not hold its budget (see $results)"
log "-- $(tail -1 "$results")"

if [ -n "$no_cuda" ]; then
  log "gpu_check: NO CUDA ($no_cuda): built and checked on CPU only; nothing measured on a GPU"
  exit 3
fi

# 4. CUDA: the test suite in the CUDA build, then the caching allocator's counters read by memfit.
grep -q 'CUDA support: 1' "$results" ||
  log "warning: memfit was configured without CUDA support (its configure line above says which Torch it found)"
log "$("$memfit" --version)"
MEMFIT_TEST_PYTHON=$py run "ctest" ctest --test-dir "$build" --output-on-failure -j"$jobs" --timeout 300
ctest_rc=$?
run "CUDA allocated vs reserved (memfit report --json, default GPT)" bash -c \
  "'$memfit' report --threads $jobs --steps 2 --json | '$py' -c 'import json, sys; j = json.load(sys.stdin); print(json.dumps(j[\"device_memory\"]))'"
report_rc=$?
# The step on the GPU: a report (CUDA allocator bytes in the breakdown) and a plan verified by
# real steps under 60% of the plain peak, both with --device cuda.
run "memfit report --device cuda" "$memfit" report "${tiny[@]}" --device cuda --steps 2
cuda_report_rc=$?
gpu_peak=$(timeout "$(left)" "$memfit" report "${tiny[@]}" --device cuda --steps 2 --json 2>> "$results" |
  "$py" -c 'import json, sys; print(json.load(sys.stdin)["peak_bytes"])')
run "memfit plan --device cuda" "$memfit" plan "${tiny[@]}" --device cuda --budget "$((${gpu_peak:-0} * 60 / 100))"
cuda_plan_rc=$?
[ $ctest_rc -eq 0 ] && [ $report_rc -eq 0 ] && [ $cuda_report_rc -eq 0 ] && [ $cuda_plan_rc -eq 0 ] ||
  fail "ctest exit $ctest_rc, CUDA report exit $report_rc/$cuda_report_rc, CUDA plan exit $cuda_plan_rc (see $results)"
log "gpu_check: OK (CUDA build, ctest passed, plan verified on CPU and GPU; results in $results)"
