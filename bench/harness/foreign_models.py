"""Models memfit's authors did not write, exported as a user would: run with Debian's /usr/bin/python3.

    python3 foreign_models.py OUT_DIR [MODEL ...]

MODEL (default: all): resnet18, mobilenet_v2, gpt2_traced. Each writes OUT_DIR/MODEL.pt (a
scripted nn.Sequential of blocks) and OUT_DIR/MODEL_data.pt (torch.save({"inputs", "targets"})).

- resnet18, mobilenet_v2: torchvision's models, untouched, cut into an nn.Sequential of the
  stages their forward runs (ResNet's `relu` stage is ReLU(inplace=True): a block whose first
  op writes into its input).
- gpt2_traced: a small GPT-2 written after Hugging Face's (Conv1D projections, tanh GELU,
  a causal-mask buffer, per-call scalar tensors, dropout 0.1, the output layer's weight tied to
  the token embedding), each block exported with torch.jit.trace (shape-specialised constants
  and all), then the Sequential scripted.
"""
import math
import os
import sys

import torch
import torch.nn as nn

IMAGE = int(os.environ.get("IMAGE", 224))  # pixels a side: ImageNet's unless IMAGE says


def resnet18():
    import torchvision
    m = torchvision.models.resnet18(num_classes=100)
    return nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, m.layer2, m.layer3, m.layer4,
                         m.avgpool, nn.Flatten(1), m.fc)


def mobilenet_v2():
    import torchvision
    m = torchvision.models.mobilenet_v2(num_classes=100)
    return nn.Sequential(*m.features, nn.AdaptiveAvgPool2d(1), nn.Flatten(1), *m.classifier)


def image_data(n=64, classes=100):  # few samples: the data counts against the budget
    x = torch.randn(n, 3, IMAGE, IMAGE)
    return {"inputs": x, "targets": torch.randint(0, classes, (n,))}


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 projection: y = x @ W + b with W stored (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def new_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Attention(nn.Module):
    def __init__(self, d, heads, positions, dropout):
        super().__init__()
        self.heads, self.d = heads, d
        self.register_buffer("bias", torch.tril(torch.ones(positions, positions, dtype=torch.bool)).view(1, 1, positions, positions))
        self.c_attn, self.c_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)

    def split(self, t):
        return t.view(t.size()[:-1] + (self.heads, self.d // self.heads)).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.d, dim=2)
        q, k, v = self.split(q), self.split(k), self.split(v)
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
        t = q.size(-2)
        mask = self.bias[:, :, :t, :t]
        w = torch.where(mask, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
        w = self.attn_dropout(nn.functional.softmax(w, dim=-1))
        y = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous()
        y = y.view(y.size()[:-2] + (self.d,))
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, d, heads, positions, dropout):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, positions, dropout)
        self.c_fc, self.c_proj, self.dropout = Conv1D(4 * d, d), Conv1D(d, 4 * d), nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.c_proj(new_gelu(self.c_fc(self.ln_2(x)))))


class Embed(nn.Module):
    def __init__(self, vocab, positions, d, dropout):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(vocab, d), nn.Embedding(positions, d), nn.Dropout(dropout)

    def forward(self, ids):
        pos = torch.arange(0, ids.size(-1), dtype=torch.long, device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(pos))


class Head(nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


GPT = dict(vocab=4096, seq=128, d=256, heads=8, layers=6, dropout=0.1)


def gpt2_eager():
    g = GPT
    blocks = [Embed(g["vocab"], g["seq"], g["d"], g["dropout"])]
    blocks += [Block(g["d"], g["heads"], g["seq"], g["dropout"]) for _ in range(g["layers"])]
    blocks.append(Head(g["d"], g["vocab"]))
    blocks[-1].lm_head.weight = blocks[0].wte.weight  # tied, as GPT-2's (one parameter, two blocks)
    return nn.Sequential(*blocks)


def gpt2_traced():
    g = GPT
    blocks = list(gpt2_eager())
    x = torch.randint(0, g["vocab"], (2, g["seq"]))
    traced = []
    for b in blocks:  # each traced on its own input, as an exporter cutting a model would
        b.train()
        with torch.no_grad():
            t = torch.jit.trace(b, (x,), check_trace=False)
            x = b(x)
        traced.append(t)
    return nn.Sequential(*traced)


def gpt_data(n=512):
    ids = torch.randint(0, GPT["vocab"], (n, GPT["seq"]))
    return {"inputs": ids, "targets": torch.roll(ids, -1, dims=1)}


MODELS = {
    "resnet18": (resnet18, image_data),
    "mobilenet_v2": (mobilenet_v2, image_data),
    "gpt2_traced": (gpt2_traced, gpt_data),
}


def main(out, names):
    for name in names or MODELS:
        make, data = MODELS[name]
        torch.manual_seed(0)
        model = make().train()
        torch.jit.script(model).save(f"{out}/{name}.pt")
        torch.save(data(), f"{out}/{name}_data.pt")
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, {len(model)} blocks")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
