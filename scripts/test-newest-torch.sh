#!/usr/bin/env bash
# memfit against the newest torch on PyPI, unpinned: the LibTorch suite and the Python suite,
# in a venv and a build folder of their own. CI pins a release (scripts/test-torch2.sh); this
# says whether the next one breaks anything before the pin is raised.
#
#   bash scripts/test-newest-torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-torch-newest
build=build-torch-newest
TORCH2_VERSION=newest TORCH2_VENV=$venv TORCH2_BUILD_DIR=$build bash scripts/test-torch2.sh
MEMFIT_LIBRARY=$PWD/$build/libmemfit.a MEMFIT_CLI=$PWD/$build/memfit bash scripts/test-python.sh "$venv"
