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
if [ ! -x "$venv/bin/python" ]; then
  # Debian's python3 (the one python3-torch is installed for), whatever python3 is first on PATH.
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check . pytest
# The trainers memfit.integrations plugs into, pinned per torch (transformers 5 needs torch 2.x).
# Lightning needs torch 2.x (its LightningModule does not construct on Debian's 1.13 under Python 3.11).
if "$venv/bin/python" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)'; then
  "$venv/bin/pip" install -q --disable-pip-version-check transformers==5.25.0 accelerate==1.16.0 lightning==2.6.6
else
  "$venv/bin/pip" install -q --disable-pip-version-check transformers==4.40.2 accelerate==0.30.1
fi
echo "test-python: memfit built for torch $("$venv/bin/python" -c 'import memfit; print(memfit.built_torch_version())') ($((SECONDS - start)) s)"
# Idle OpenMP threads sleep: spinning ones slow every op many times over on a shared machine.
OMP_WAIT_POLICY=passive "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests
echo "test-python: done in $((SECONDS - start)) s"
