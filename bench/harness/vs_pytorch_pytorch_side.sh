#!/usr/bin/env bash
# The PyTorch side of bench/harness/vs_pytorch.sh: memfit's reference models trained with plain PyTorch
# 1.13 (Debian's python3-torch) under each memory-saving variant; one JSON line per run.
#
#   bash bench/harness/vs_pytorch_pytorch_side.sh OUT.jsonl [THREADS] [STEPS]
#
# GPT (defaults: 8 layers, d 256, 8 heads, seq 128, batch 16, dropout 0.1, KJV text):
#   eager, ckpt_seq:2, ckpt_seq:4, ckpt_seq:8, autocast_bf16
# CNN (defaults: 6 blocks, 32 channels, batch 16, Fashion-MNIST):
#   eager, ckpt_seq:2, ckpt_seq:4, ckpt_seq:7
#   (no autocast_bf16: in 1.13, GroupNorm under CPU bf16 autocast throws
#    "expected scalar type BFloat16 but found Float"; set CNN_BF16=1 to try anyway)
# See bench/PYTORCH_SIDE.md and the docstring of bench/harness/pytorch_twin.py.
set -euo pipefail
out=${1:?usage: $0 OUT.jsonl [THREADS] [STEPS]}
threads=${2:-2}
steps=${3:-5}
py=/usr/bin/python3   # Debian's interpreter: the one that sees python3-torch
here=$(cd "$(dirname "$0")" && pwd)
: > "$out"
run() {
  echo "== $*" >&2
  "$py" "$here/pytorch_twin.py" "$@" --threads "$threads" --steps "$steps" --json >> "$out"
}
for v in eager ckpt_seq:2 ckpt_seq:4 ckpt_seq:8 autocast_bf16; do
  run --model gpt --variant "$v"
done
cnn_variants="eager ckpt_seq:2 ckpt_seq:4 ckpt_seq:7"
if [[ ${CNN_BF16:-0} == 1 ]]; then cnn_variants+=" autocast_bf16"; fi
for v in $cnn_variants; do
  run --model cnn --variant "$v"
done
echo "wrote $(wc -l < "$out") results to $out" >&2
