#!/usr/bin/env bash
# The Python package's tests against one torch: `pip install .` into a virtual environment, as
# the README's commands do, then pytest on python/tests (the installed memfit is imported).
#
#   bash scripts/test-python.sh                # Debian's python3-torch 1.13: .venv-py, with system site packages
#   bash scripts/test-python.sh .venv-torch2   # a venv holding torch 2.x (scripts/test-torch2.sh makes it)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-py}
start=$SECONDS
bash scripts/python-env.sh "$venv"  # torch's venv; pytest and the trainers, per torch
"$venv/bin/pip" install -q --disable-pip-version-check .
echo "test-python: memfit built for torch $("$venv/bin/python" -c 'import memfit; print(memfit.built_torch_version())') ($((SECONDS - start)) s)"
# Idle OpenMP threads sleep: spinning ones slow every op many times over on a shared machine.
OMP_WAIT_POLICY=passive "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests
echo "test-python: done in $((SECONDS - start)) s"
