#!/usr/bin/python3
"""The user's models of the TorchScript benchmark: Python models, as a PyTorch user writes them,
exported the way docs/cli.md says (an nn.Sequential of blocks, torch.jit.script, torch.save
of the data). The blocks are tests/torchscript/export_models.py's; the sizes here are a
training step's, not a test's.

    /usr/bin/python3 bench/harness/user_models.py OUT_DIR

writes OUT_DIR/{gpt,cnn}.pt (TorchScript) and OUT_DIR/{gpt,cnn}_data.pt. The factories gpt()
and cnn() build the same models as Python modules (bench/harness/pytorch_twin.py --eager
bench/harness/user_models.py:gpt loads the TorchScript file's weights into them).
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "torchscript"))
from export_models import Block, Embed, Head, ResBlock  # noqa: E402

# GPT-2-style, character level: [B, 128] token ids -> [B, 128, 96] logits; 6 blocks of d=256.
VOCAB, SEQ, D, HEADS, LAYERS = 96, 128, 256, 8, 6
# Residual CNN with BatchNorm: [B, 3, 32, 32] images -> 10 classes; 4 residual blocks of 48.
CHANNELS, RES_BLOCKS, SIZE = 48, 4, 32
SAMPLES = 2048


def gpt():
    return nn.Sequential(Embed(VOCAB, SEQ, D), *[Block(D, HEADS) for _ in range(LAYERS)], Head(D, VOCAB))


def cnn():
    return nn.Sequential(nn.Sequential(nn.Conv2d(3, CHANNELS, 3, padding=1), nn.BatchNorm2d(CHANNELS), nn.ReLU()),
                         *[ResBlock(CHANNELS) for _ in range(RES_BLOCKS)],
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, 10)))


def main(out):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    torch.jit.script(gpt()).save(os.path.join(out, "gpt.pt"))
    torch.jit.script(cnn()).save(os.path.join(out, "cnn.pt"))
    x = torch.randint(0, VOCAB, (SAMPLES, SEQ))
    torch.save({"inputs": x, "targets": (x * 7 + 3) % VOCAB}, os.path.join(out, "gpt_data.pt"))
    images = torch.randn(SAMPLES, 3, SIZE, SIZE)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long() + 2 * (images[:, 0, 0, 0] > 0).long()
    torch.save({"inputs": images, "targets": labels}, os.path.join(out, "cnn_data.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
