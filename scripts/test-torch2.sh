#!/usr/bin/env bash
# The second build: memfit against LibTorch 2.x from PyPI's `torch` wheel (CUDA 13 variant: it
# carries libtorch_cuda and links NCCL), then the whole test suite on the CPU. CI runs it after
# scripts/test.sh, which installs the Debian packages both builds share.
#
#   bash scripts/test-torch2.sh
#
# Environment: TORCH2_VERSION (2.15.0: PyPI's newest release, pinned so that a new release
# cannot break a landing by surprise; raised as new ones come out. 2.11.0: what the GPU
# machines run. "newest": whatever PyPI has now, unpinned: scripts/test-newest-torch.sh),
# TORCH2_VENV (.venv-torch2), TORCH2_BUILD_DIR (build-torch2), TORCH2_JOBS (all cores),
# TORCH2_PHASE (all; build: the venv and the build only; test: the suite of a build made before).
#
# The C++ standard follows the torch: its CMake config asks C++20 from 2.12 (CMakeLists.txt).
#
# The wheel's LibTorch is used as-is: -DCMAKE_PREFIX_PATH names the torch package folder (for
# its lib/, before the system's /usr/lib where Debian's 1.13 lives) and its share/cmake (for
# TorchConfig.cmake). Its CUDA libraries (cuBLAS, cuDNN, NCCL, ...) come as the wheel's pip
# dependencies; CMake's CUDA checks use the machine's toolkit (nvcc). No GPU is needed: a CUDA
# build of torch runs on the CPU where none is present. The tests' Python side (exports,
# checks, the PyTorch twin) uses the same torch, from the virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${TORCH2_VERSION:-2.15.0}
venv=$(realpath -m "${TORCH2_VENV:-.venv-torch2}")
build=${TORCH2_BUILD_DIR:-build-torch2}
jobs=${TORCH2_JOBS:-$(nproc)}
start=$SECONDS

# The CUDA toolkit's nvcc: Caffe2's CMake config looks for it when the Torch is a CUDA build.
for d in /usr/local/cuda/bin /usr/local/cuda-13*/bin; do
  [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
done
command -v nvcc >/dev/null || { echo "test-torch2: nvcc not found (the CUDA 13 toolkit is needed to configure a CUDA LibTorch)" >&2; exit 1; }

phase=${TORCH2_PHASE:-all}
if [ "$phase" != test ]; then
  t0=$SECONDS
  bash scripts/python-env.sh "$venv" "$version"  # (CI has it made while the first build compiles)
  echo "test-torch2: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') installed in $venv ($((SECONDS - t0)) s)"
  torch_dir=$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
  t0=$SECONDS
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMEMFIT_BUILD_BENCH=OFF \
    "-DCMAKE_PREFIX_PATH=$torch_dir;$torch_dir/share/cmake" >/dev/null
  cmake --build "$build" -j"$jobs"
  echo "test-torch2: built $build ($((SECONDS - t0)) s)"
fi
[ "$phase" = build ] && exit 0

echo "test-torch2: $("$build/memfit" --version)"
echo "test-torch2: $build/memfit links: $(ldd "$build/memfit" | grep -oE 'lib(torch_cuda|c10_cuda|nccl)[^ ]*' | sort -u | paste -sd' ')"

export MEMFIT_TEST_PYTHON="$venv/bin/python"
cd "$build"
ctest --output-on-failure -j"$jobs" --timeout 900
echo "test-torch2: done in $((SECONDS - start)) s"
