#!/usr/bin/env bash
# Installs what memfit needs on a fresh Debian 12 machine, then configures and builds it.
# Idempotent: packages already present are not fetched again.
#   bash scripts/setup.sh            # release build in ./build
#   BUILD_DIR=out bash scripts/setup.sh
#   bash scripts/setup.sh --packages # the packages only
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake pkg-config
  libtorch-dev            # LibTorch 1.13 (CPU)
  libopenblas0-pthread    # fast BLAS: Debian's libtorch otherwise uses the reference BLAS (~46x slower)
  libgtest-dev libcli11-dev nlohmann-json3-dev libfmt-dev zlib1g-dev libssl-dev
  libgloo-dev             # headers c10d's ProcessGroupGloo includes
  bible-kjv bible-kjv-text dataset-fashion-mnist   # the built-in data
  python3-torch           # the PyTorch peer for side-by-side benchmarks, and the Python package's torch
  python3-venv pybind11-dev   # the Python package's virtual environments and bindings (README, "From Python")
  chromium                # the browser test of the HTML report
)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
[ "${1:-}" = --packages ] && exit 0  # (CI: the packages first, then the builds and a venv's downloads side by side)

build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build_dir" -j"$(nproc)"
echo "setup: built $build_dir/memfit"
