#!/usr/bin/env bash
# A real `memfit report --html` opened in headless Chromium: chart present, categories
# labelled, the shown peak equal to the JSON's peak_bytes.
set -euo pipefail
memfit=$1
check=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(report --layers 2 --d-model 64 --heads 4 --seq 32 --batch 4 --steps 2)
"$memfit" "${args[@]}" --json --html "$dir/report.html" > "$dir/report.json"
peak=$("${MEMFIT_TEST_PYTHON:-/usr/bin/python3}" -c 'import json,sys; print(json.load(open(sys.argv[1]))["peak_bytes"])' "$dir/report.json")
bash "$check" "$dir/report.html" "$peak"
