"""memfit.plan + memfit.apply on three models no test names: torchvision's resnet18 and a small
torchvision VisionTransformer (Debian's python3-torchvision with torch 1.13), and a GPT-2 written
as Hugging Face's (Conv1D layers, blocks in a ModuleList called with an attention mask and
keyword arguments, returning tuples, the head tied to the embedding). For each, at 60% and 45%
of the plain step's peak (and at 45% in fp32 alone, where checkpointing must do the work): the
plan, the peak memfit.budget measured over two steps, and the prediction's error. Prints one
markdown table; exits 1 if a step went over its budget or missed its prediction by over 5%.

    OMP_WAIT_POLICY=passive .venv/bin/python bench/python/unnamed_models.py
"""
import gc
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import memfit


class Conv1D(nn.Module):  # Hugging Face's GPT-2 linear layer: weight [in, out], addmm
    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class GPT2Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, Conv1D(3 * d, d), Conv1D(d, d)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, x, attention_mask=None, layer_past=None, use_cache=False):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        w = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        w = torch.where(causal, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype)) + attention_mask
        out = (self.attn_dropout(w.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_dropout(self.c_proj(out)), ((k, v) if use_cache else None)


class GPT2Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), GPT2Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.ModuleDict(dict(c_fc=Conv1D(4 * d, d), c_proj=Conv1D(d, 4 * d), dropout=nn.Dropout(0.1)))

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        a, present = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask, use_cache=use_cache)
        hidden_states = hidden_states + a
        m = self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(hidden_states)), approximate="tanh"))
        return (hidden_states + self.mlp["dropout"](m), present)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, vocab=512, positions=128, d=128, layers=6, heads=4):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(vocab, d), nn.Embedding(positions, d), nn.Dropout(0.1)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's

    def forward(self, input_ids, attention_mask, labels=None):
        x = self.drop(self.wte(input_ids) + self.wpe(torch.arange(input_ids.size(1), device=input_ids.device)))
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for block in self.h:
            x = block(x, layer_past=None, attention_mask=mask, use_cache=False)[0]
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def gpt2():
    ids = torch.randint(0, 512, (16, 128))
    mask = torch.ones(16, 128, dtype=torch.long)
    mask[::4, -16:] = 0
    return GPT2LMHeadModel(), {"input_ids": ids, "attention_mask": mask, "labels": ids}, lambda m, b: m(**b)["loss"]


def resnet18():
    import torchvision
    batch = (torch.randn(48, 3, 128, 128), torch.randint(0, 10, (48,)))
    return torchvision.models.resnet18(num_classes=10), batch, lambda m, b: F.cross_entropy(m(b[0]), b[1])


def vit():
    import torchvision
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=4, num_layers=6, num_heads=4,
                                                 hidden_dim=128, mlp_dim=512, num_classes=10)
    batch = (torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))
    return model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1])


MODELS = {"torchvision resnet18 (batch 48, 128x128)": resnet18, "torchvision VisionTransformer (6 layers, batch 64)": vit,
          "GPT-2 written as Hugging Face's (6 layers, batch 16 x 128)": gpt2}


def steps_peak(step, batch, budget):
    with memfit.budget(budget) as b:
        for _ in range(2):
            step(batch)
    return b.peak_bytes


def applied_peak(model, opt, plan, batch, budget, peak_of=steps_peak):
    """The plan applied to the model (taken off after): its Step, its steps' peak under the
    budget (peak_of), and the prediction's error as a fraction of that peak."""
    step = memfit.apply(model, opt, plan)
    try:
        measured = peak_of(step, batch, budget)
    finally:
        memfit.remove(model)
    return step, measured, (plan.predicted_peak_bytes - measured) / measured


def plain(model, opt, loss_fn, batch):
    def step(b):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, b).backward()
        opt.step()
    return step


def row(label, make, fraction, precisions):
    torch.manual_seed(0)
    gc.collect()
    model, batch, loss_fn = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_peak = steps_peak(plain(model, opt, loss_fn, batch), batch, 1 << 40)
    del opt
    gc.collect()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = int(plain_peak * fraction)
    plan = memfit.plan(model, opt, loss_fn, batch, budget, precisions=precisions, progress=False)
    _, measured, error = applied_peak(model, opt, plan, batch, budget)
    mib = 1 << 20
    config = (f"{plan.micro_batch} x {plan.accumulation}, {plan.precision}, {len(plan.checkpointed)}/"
              f"{len(plan.block_names)} blocks recomputed, {plan.optimizer_state} state")
    ok = "yes" if measured <= budget and abs(error) <= 0.05 else "NO"
    return (f"| {label} | {fraction:.0%}, {'/'.join(precisions)} | {plain_peak / mib:.1f} | {budget / mib:.1f} | {config} | "
            f"{plan.predicted_peak_bytes / mib:.2f} | {measured / mib:.2f} | {error:+.1%} | {ok} |")


def main():
    print(f"torch {torch.__version__}, memfit built for {memfit.built_torch_version()}, {torch.get_num_threads()} threads")
    print("| model | budget, precisions | plain peak MiB | budget MiB | plan | predicted MiB | measured MiB | error | fits, within 5% |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    failed = 0
    for label, make in MODELS.items():
        for fraction, precisions in ((0.6, ("fp32", "bf16")), (0.45, ("fp32", "bf16")), (0.45, ("fp32",))):
            line = row(label, make, fraction, precisions)
            failed += line.endswith("NO |")
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
