"""Exports the user models memfit's TorchScript tests train: run with Debian's /usr/bin/python3.

    python3 export_models.py OUT_DIR

writes, each with its data (torch.save({"inputs": X, "targets": Y})):
  gpt.pt, gpt_data.pt     a GPT-2-style nn.Sequential of blocks (token ids in, logits out)
  cnn.pt, cnn_data.pt     a residual CNN with BatchNorm as an nn.Sequential of blocks
  plain.pt                the same GPT as one module that is not a Sequential (runs as one block)
  lossy.pt                a module whose forward(inputs, targets) returns the loss (--loss model)
  probe.pt                a fixed input for comparing outputs: {"inputs": X}
  inplace.pt, inplace_data.pt  a CNN whose blocks start by writing into their input
                          (ReLU(inplace=True), SiLU(inplace=True), x.add_), as torchvision's do
  boom.pt                 a block that raises once given more than one sample (error messages)
"""
import math
import sys

import torch
import torch.nn as nn


class Embed(nn.Module):
    def __init__(self, vocab, seq, d):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)

    def forward(self, x):
        return self.tok(x) + self.pos[: x.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, device=x.device).tril() == 0
        scores = scores.masked_fill(mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(torch.relu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, vocab)

    def forward(self, x):
        return self.fc(self.ln(x))


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class AddOne(nn.Module):
    """Writes into its input, then convolves."""

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(x.add_(1.0))


class Boom(nn.Module):
    def forward(self, x):
        if x.size(0) > 1:
            raise RuntimeError("boom: more than one sample")
        return x


class Plain(nn.Module):
    """The GPT as one module with its own forward: not a Sequential."""

    def __init__(self, seq):
        super().__init__()
        self.net = gpt(seq)

    def forward(self, x):
        return self.net(x)


class Lossy(nn.Module):
    """forward(inputs, targets) returns the scalar loss."""

    def __init__(self, seq):
        super().__init__()
        self.net = gpt(seq)

    def forward(self, x, y):
        logits = self.net(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


VOCAB, SEQ, D, HEADS, LAYERS = 48, 32, 64, 4, 3


def gpt(seq):
    return nn.Sequential(Embed(VOCAB, seq, D), *[Block(D, HEADS) for _ in range(LAYERS)], Head(D, VOCAB))


def cnn():
    return nn.Sequential(nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()),
                         ResBlock(16), ResBlock(16),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)))


def inplace_cnn():
    """Each block whose first op writes into its input follows one whose graph does not keep
    that tensor (a Conv2d's or BatchNorm's output), as eager PyTorch requires."""
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                         nn.Conv2d(16, 16, 3, padding=1),
                         nn.Sequential(nn.SiLU(inplace=True), nn.Conv2d(16, 16, 3, padding=1)),
                         AddOne(16),
                         nn.Sequential(nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)))


def main(out):
    torch.manual_seed(0)
    torch.jit.script(gpt(SEQ)).save(f"{out}/gpt.pt")
    torch.jit.script(cnn()).save(f"{out}/cnn.pt")
    torch.jit.script(Plain(SEQ)).save(f"{out}/plain.pt")
    torch.jit.script(Lossy(SEQ)).save(f"{out}/lossy.pt")
    # Text-like data: the next token is a fixed function of the current one, so loss can fall.
    x = torch.randint(0, VOCAB, (512, SEQ))
    torch.save({"inputs": x, "targets": (x * 7 + 3) % VOCAB}, f"{out}/gpt_data.pt")
    images = torch.randn(512, 1, 16, 16)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long() + 2 * (images[:, 0, 0, 0] > 0).long()
    torch.save({"inputs": images, "targets": labels}, f"{out}/cnn_data.pt")
    torch.save({"inputs": torch.randint(0, VOCAB, (2, SEQ))}, f"{out}/probe.pt")
    torch.jit.script(inplace_cnn()).save(f"{out}/inplace.pt")
    torch.save({"inputs": torch.randn(256, 1, 24, 24), "targets": torch.randint(0, 10, (256,))}, f"{out}/inplace_data.pt")
    torch.jit.script(nn.Sequential(nn.Linear(8, 8), Boom(), nn.Linear(8, 4))).save(f"{out}/boom.pt")
    torch.save({"inputs": torch.randn(64, 8), "targets": torch.randint(0, 4, (64,))}, f"{out}/boom_data.pt")


if __name__ == "__main__":
    main(sys.argv[1])
