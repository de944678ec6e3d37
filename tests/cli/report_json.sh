#!/usr/bin/env bash
# memfit report --json on a small GPT: the documented fields, parts summing to the peak.
set -euo pipefail
memfit=$1
json=$("$memfit" report --layers 2 --d-model 64 --heads 4 --seq 32 --batch 4 --steps 2 --json)
/usr/bin/python3 - "$json" <<'PY'
import json, sys
j = json.loads(sys.argv[1])
p = j["at_peak"]
parts = p["weights"] + p["gradients"] + p["optimizer_state"] + p["activations"] + p["other"]
assert parts == j["peak_bytes"], (parts, j["peak_bytes"])
assert j["states"]["weights"] == j["parameters"] * 4
assert j["states"]["gradients"] == j["parameters"] * 4
assert j["states"]["optimizer_state"] == 2 * j["parameters"] * 4
assert len(j["blocks"]) == 6 and all(b["activation_bytes"] > 0 for b in j["blocks"])
assert j["device_memory"]["cpu"]["reserved_bytes"] == j["device_memory"]["cpu"]["allocated_bytes"] == j["between_steps_bytes"]
for phase in ("forward", "backward", "optimizer"):
    assert j["phases"][phase]["peak_bytes"] > 0
print("cli report json: 1 passed, 0 failed")
PY
