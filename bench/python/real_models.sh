#!/usr/bin/env bash
# Real models from their own libraries (bench/python/real_models.py): a virtual environment over
# Debian's torch 1.13 with transformers 4.40.2 from PyPI and Debian's python3-torchvision, memfit
# installed into it from this checkout, then the table.
#
#   bash bench/python/real_models.sh [MODEL-NAME-PART ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv-hf
dpkg -s python3-torchvision >/dev/null 2>&1 || {
  echo "real_models: needs Debian's python3-torchvision (apt-get install python3-torchvision)"; exit 2; }
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "transformers==4.40.2" .
source bench/harness/quiet_env.sh
exec "$venv/bin/python" bench/python/real_models.py "$@"
