#!/usr/bin/env bash
# Sets up (installs, builds) and runs the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cd "${BUILD_DIR:-build}"
# MEMFIT_CTEST_EXCLUDE: a regex of tests to leave out (CI: what its other builds cover).
ctest --output-on-failure -j"$(nproc)" --timeout 900 ${MEMFIT_CTEST_EXCLUDE:+-E "$MEMFIT_CTEST_EXCLUDE"}
