#!/usr/bin/env bash
# The GPU check: on a machine with CUDA and PyTorch 2.x, builds memfit against that PyTorch's
# LibTorch (or takes a CLI built elsewhere), then runs memfit against the CUDA caching allocator
# itself (bench/harness/gpu_allocator_check.py: the plain step's reserved peak predicted against
# max_memory_reserved; `memfit train --device cuda` 20 steps at 90/60/45% of it, the GPT in fp32
# and bf16, the CNN, a TorchScript GPT in bf16, with no allocator retry or out-of-memory error;
# the optimizer offloaded; and with a wheel, the Python package's memfit.fit on a Hugging
# Face-style GPT-2 at 60/45%: one markdown table with the card's name, for bench/RESULTS.md),
# then, with the time left, the test suite (ctest) in that CUDA build. Within 7 minutes by
# default; everything goes to one results file.
#
#   bash bench/gpu_check.sh [RESULTS_FILE]          # default: gpu_check.txt
#
#   PYTHON=...                 the interpreter with PyTorch (default: the first of python3 and
#                              /usr/bin/python3 that imports torch)
#   GPU_CHECK_BUILD_DIR=DIR    build there (default: build-gpu-check); a directory that is
#                              already configured is reused as it is (no second full build)
#   GPU_CHECK_JOBS=N           compile jobs (default: all cores)
#   GPU_CHECK_SECONDS=S        the whole check's time limit (default 420: 8 minutes of device time
#                              with the machine's start)
#   GPU_CHECK_WHEEL=FILE       the Python package's wheel, built elsewhere for this torch (pip wheel
#                              . with it): installed into a temporary folder, its rows added
#   GPU_CHECK_REHEARSE=1       first, every GPU row on the CPU with tiny shapes (their commands and
#                              fields checked before a GPU's time is spent on them)
#   GPU_CHECK_CTEST=0          skip the test suite (the allocator check alone)
#   GPU_CHECK_MEMFIT=FILE      a memfit CLI built elsewhere against the same LibTorch (carried to
#                              the machine): no configure, no build, no test suite; the libraries
#                              beside FILE and the torch package's lib/ go on LD_LIBRARY_PATH
#   GPU_CHECK_ZERO3_ROUNDS=N   first, ZeRO 3 against ZeRO 2 on this machine's CPU cores (issue 33:
#                              bench/harness/zero3_step_time.sh at 2 and 4 ranks, N rounds, half
#                              the cores computing, the rest free for Gloo's transfers), after
#                              bench/harness/cpu_matmul_bits.py (do the products' bits follow the
#                              address?); default 0
#   GPU_CHECK_ZERO3_MODEL="flags"  that comparison's model (default: a GPT of 4 layers, d=512); ZERO3_VARIANTS is passed on
#
# Without CUDA (no nvidia-smi, no torch, or torch.cuda.is_available() false) it still runs its
# CPU parts (configure, build the CLI, the plan check), then says so in one line starting
# "gpu_check: NO CUDA" and exits 3: a machine without a GPU never passes for a GPU check.
# PyTorch wheels built with the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0) may not link with
# Debian's libfmt/gtest; the build step then fails and says so here.
# It builds the way scripts/test-torch2.sh does (the torch package folder and its share/cmake on
# the prefix path, nvcc on PATH, no benchmarks). The built-in GPT reads any text (the
# repository's documents here); the CNN reads Fashion-MNIST, written as random stand-ins of the
# same format when Debian's dataset-fashion-mnist is not installed (MEMFIT_FASHION_MNIST_DIR).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
results=$(realpath -m "${1:-gpu_check.txt}")
build=$(realpath -m "${GPU_CHECK_BUILD_DIR:-$root/build-gpu-check}")
jobs=${GPU_CHECK_JOBS:-$(nproc)}
deadline=$(($(date +%s) + ${GPU_CHECK_SECONDS:-420}))
: > "$results"
log() { echo "$*" | tee -a "$results"; }
left() { local s=$((deadline - $(date +%s))); echo $((s > 0 ? s : 1)); }
# run LABEL CMD...: the command's output into the results file, within the time left.
run() {
  local label=$1; shift
  log "== $label: $*"
  timeout "$(left)" "$@" >> "$results" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && log "-- $label: TIMED OUT (the check's ${GPU_CHECK_SECONDS:-420} s ran out)" || log "-- $label: exit $rc"
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

# 2. Configure and build (against the PyTorch found, when it ships LibTorch's CMake files), or
# take a CLI built elsewhere.
if [ -n "${GPU_CHECK_MEMFIT:-}" ]; then
  memfit=$(realpath "$GPU_CHECK_MEMFIT")
  # (the CUDA runtime beside the torch package: the one its LibTorch was built with)
  export LD_LIBRARY_PATH="$(dirname "$memfit")${torch_dir:+:$torch_dir/lib:$torch_dir/../nvidia/cu13/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "using the memfit built elsewhere: $memfit ($("$memfit" --version 2>&1 | head -1)); no build, no test suite"
  GPU_CHECK_CTEST=0
else
  if [ -f "$build/CMakeCache.txt" ]; then
    log "reusing the configured build directory $build (Torch_DIR $(grep -m1 '^Torch_DIR' "$build/CMakeCache.txt" | cut -d= -f2))"
    run "configure" cmake -S "$root" -B "$build" || fail "configure failed (see $results)"
  else
    run "configure" cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMEMFIT_BUILD_BENCH=OFF \
      ${prefix:+"-DCMAKE_PREFIX_PATH=$prefix"} \
      || fail "configure failed (see $results)"
  fi
  # The CLI first: the allocator check needs only it; the rest (ctest's) is built after, with the time left.
  run "build memfit" cmake --build "$build" -j"$jobs" --target memfit_cli || fail "build failed (see $results)"
  memfit=$build/memfit
fi

# The built-in GPT's default text is Debian's King James Bible, read once into memfit's cache;
# where neither is there, the repository's documents stand in for it (any text will do).
cache=${MEMFIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/memfit}
if ! command -v bible > /dev/null && [ ! -f "$cache/kjv.txt" ]; then
  export MEMFIT_CACHE=$(mktemp -d)
  cat "$root"/README.md "$root"/ARCHITECTURE.md "$root"/bench/RESULTS.md "$root"/bench/PYTORCH_SIDE.md > "$MEMFIT_CACHE/kjv.txt"
  log "no King James Bible here: the repository's documents stand in for it ($(wc -c < "$MEMFIT_CACHE/kjv.txt") bytes, in $MEMFIT_CACHE)"
fi

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
c = j["config"]
print("plan check: %d x %d, %s, measured peak %d <= budget %d" % (c["micro_batch"], c["accumulation"], c["precision"], m, b))' >> "$results" 2>&1 \
  || fail "the verified plan did not hold its budget (see $results)"
log "-- $(tail -1 "$results")"

# 3b. Issue 33 on this machine's CPU cores (no GPU needed): ZeRO 3 at prefetch depths 0-2 against
# ZeRO 2, ranks over loopback (Gloo). Each rank computes on cores / ranks / 2 threads, so that the
# transfers have cores of their own, as a GPU node's do.
zero3_rc=0
if [ "${GPU_CHECK_ZERO3_ROUNDS:-0}" -gt 0 ]; then
  read -r -a zero3_model <<< "${GPU_CHECK_ZERO3_MODEL:---layers 4 --d-model 512 --heads 8 --seq 128 --batch 16 --dropout 0 --micro-batch 4}"
  # Whether this CPU's matrix products follow their operands' address, or differ on a repeat:
  # either would make the weights' hash differ between runs by chance (with this torch, which
  # may not be the one memfit links).
  [ -n "$py" ] && run "CPU matrix products' bits" "$py" "$root/bench/harness/cpu_matmul_bits.py" \
    --threads $(( $(nproc) / 4 > 0 ? $(nproc) / 4 : 1 ))
  for ranks in 2 4; do
    threads=$(( $(nproc) / ranks / 2 > 0 ? $(nproc) / ranks / 2 : 1 ))
    run "ZeRO 3 vs ZeRO 2, $ranks ranks" bash "$root/bench/harness/zero3_step_time.sh" "$memfit" "$ranks" \
      "$GPU_CHECK_ZERO3_ROUNDS" "${zero3_model[@]}" --threads "$threads" || zero3_rc=1
  done
fi

# The Python package, from a wheel built elsewhere for this torch (no compiler needed here):
# installed into the work folder, beside the interpreter's own packages.
wheel_python=""
if [ -n "${GPU_CHECK_WHEEL:-}" ] && [ -n "$py" ]; then
  pkg=$(mktemp -d)
  if "$py" -m pip install -q --no-deps --no-index --target "$pkg" "$GPU_CHECK_WHEEL" >> "$results" 2>&1; then
    wheel_python="$pkg/python"
    printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec "%s" "$@"\n' "$pkg" "$(command -v "$py")" > "$wheel_python"
    chmod +x "$wheel_python"
    log "the Python package from $GPU_CHECK_WHEEL: $("$wheel_python" -c 'import memfit; print("memfit built for torch", memfit.built_torch_version())' 2>&1 | tail -1)"
  else
    log "warning: $GPU_CHECK_WHEEL did not install (see above): no Python rows"
  fi
fi

# The rows rehearsed on the CPU (GPU_CHECK_REHEARSE=1): the same commands and fields, tiny shapes.
if [ "${GPU_CHECK_REHEARSE:-0}" = 1 ]; then
  rehearsal=$(mktemp -d)
  log "== the GPU rows rehearsed on the CPU (bench/harness/gpu_allocator_check.py --rehearse)"
  timeout "$(left)" "${py:-/usr/bin/python3}" "$root/bench/harness/gpu_allocator_check.py" "$memfit" "$rehearsal" \
    --python "${py:-/usr/bin/python3}" ${wheel_python:+--python-package "$wheel_python"} --deadline "$deadline" --rehearse 2>&1 |
    tee -a "$results"
  log "-- rehearsal: exit ${PIPESTATUS[0]}"
fi

if [ -n "$no_cuda" ]; then
  log "gpu_check: NO CUDA ($no_cuda): built and checked on CPU only; nothing measured on a GPU"
  exit 3
fi

# 4. CUDA: the caching allocator model against the allocator itself, on the card.
[ -n "${GPU_CHECK_MEMFIT:-}" ] || grep -q 'CUDA support: 1' "$results" ||
  log "warning: memfit was configured without CUDA support (its configure line above says which Torch it found)"
log "$("$memfit" --version)"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  export MEMFIT_FASHION_MNIST_DIR=$work/fashion-mnist
  "$py" - "$MEMFIT_FASHION_MNIST_DIR" <<'PY'
import gzip, os, random, struct, sys
d = sys.argv[1]; os.makedirs(d, exist_ok=True); rng = random.Random(0)
for prefix, n in (("train", 8192), ("t10k", 1024)):
    with gzip.open(os.path.join(d, prefix + "-images-idx3-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">IIII", 2051, n, 28, 28) + rng.randbytes(n * 784))
    with gzip.open(os.path.join(d, prefix + "-labels-idx1-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">II", 2049, n) + bytes(rng.randrange(10) for _ in range(n)))
PY
  log "Fashion-MNIST not installed: random stand-ins of its format in $MEMFIT_FASHION_MNIST_DIR"
fi
log "== allocator check on ${card:-an unnamed card} (bench/harness/gpu_allocator_check.py)"
timeout "$(left)" "$py" "$root/bench/harness/gpu_allocator_check.py" "$memfit" "$work" --python "$py" \
  ${wheel_python:+--python-package "$wheel_python"} --deadline "$deadline" --card "${card:-?}" 2>&1 | tee -a "$results"
allocator_rc=${PIPESTATUS[0]}
log "-- allocator check: exit $allocator_rc"

# 5. With the time left: the rest of the build and the test suite in this CUDA build.
ctest_rc=0
if [ "${GPU_CHECK_CTEST:-1}" = 0 ]; then
  log "ctest skipped (GPU_CHECK_CTEST=0)"
elif [ "$(left)" -lt 120 ]; then
  log "ctest skipped: $(left) s left of ${GPU_CHECK_SECONDS:-420} (GPU_CHECK_SECONDS=900 runs it too)"
else
  run "build the rest" cmake --build "$build" -j"$jobs" && \
    MEMFIT_TEST_PYTHON=$py run "ctest" ctest --test-dir "$build" --output-on-failure -j"$jobs" --timeout 300
  ctest_rc=$?
fi
[ $allocator_rc -eq 0 ] && [ $ctest_rc -eq 0 ] && [ $zero3_rc -eq 0 ] ||
  fail "allocator check exit $allocator_rc, ctest exit $ctest_rc, ZeRO 3 comparison exit $zero3_rc (see $results)"
log "gpu_check: OK on ${card:-?} (allocator model within 2% or 20 MiB, plans held their budgets; results in $results)"
