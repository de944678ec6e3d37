#!/usr/bin/env bash
# A virtual environment with what the Python tests need: torch, numpy, pytest and the trainers
# memfit.integrations plugs into, pinned per torch. Idempotent (pip skips what is there); it
# installs no memfit (scripts/test-python.sh builds it). CI runs the torch 2.x one in the
# background while the first build compiles: it is downloads, mostly.
#
#   bash scripts/python-env.sh .venv-py              Debian's python3 with its python3-torch 1.13
#   bash scripts/python-env.sh .venv-torch2 2.15.0   PyPI's torch of that version ("newest": unpinned)
#   bash scripts/python-env.sh VENV                  an existing venv: its torch, the rest checked
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1
torch_version=${2:-}
pip=("$venv/bin/pip" install -q --disable-pip-version-check)

if [ ! -x "$venv/bin/python" ]; then
  if [ -z "$torch_version" ]; then
    # Debian's python3 (the one python3-torch is installed for), whatever python3 is first on PATH.
    /usr/bin/python3 -m venv --system-site-packages "$venv"
  else
    # Python 3.11 (PyPI's torch wheels used are cp311): Debian 12's, or the first on PATH.
    python=python3
    "$python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null || python=/usr/bin/python3
    "$python" -m venv "$venv"
  fi
fi
if [ "$torch_version" = newest ]; then
  "${pip[@]}" --upgrade torch numpy
elif [ -n "$torch_version" ]; then
  "${pip[@]}" "torch==$torch_version" numpy
fi
"${pip[@]}" pytest
# transformers 5 needs torch 2.x; Lightning too (its LightningModule does not construct on
# Debian's 1.13 under Python 3.11).
if "$venv/bin/python" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)'; then
  "${pip[@]}" transformers==5.25.0 accelerate==1.16.0 lightning==2.6.6
else
  "${pip[@]}" transformers==4.40.2 accelerate==0.30.1
fi
echo "python-env: $venv has torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
