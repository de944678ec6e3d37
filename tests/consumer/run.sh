#!/usr/bin/env bash
# Installs memfit from the build tree into a temporary prefix, then builds and runs a separate
# project that does find_package(memfit) and links memfit::memfit.
set -euo pipefail
build=$1
src=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cmake --install "$build" --prefix "$dir/prefix" >/dev/null
# The LibTorch memfit was built against (a PyTorch wheel's, see scripts/test-torch2.sh), if named.
torch_prefix=$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$build/CMakeCache.txt")
cmake -S "$src" -B "$dir/build" -DCMAKE_PREFIX_PATH="$dir/prefix${torch_prefix:+;$torch_prefix}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$dir/build" -j1 >/dev/null
"$dir/build/consumer"
