"""memfit.plan + memfit.apply on models that are not a chain of repeated blocks, each of a kind
issue "every batch, every model" names: encoder-decoder transformers (every decoder block reads
the encoder's output: PyTorch's nn.Transformer, Hugging Face's BART and T5), a U-Net (skips from
the down blocks to the up blocks), a DenseNet (torchvision's, dense connections), a recurrent
language model (an embedding, a 2-layer LSTM, a head: no block repeated) and an MLP of distinct
layers (no block repeated). At 60/45/30% of the plain step's peak (offload "auto" at 30%): the
plan, the peak memfit.budget measured over three steps, and error = (measured - predicted) /
predicted. Prints one markdown table; exits 1 if a step went over its budget or missed its
prediction by more than 3% either way.

    OMP_WAIT_POLICY=passive .venv-py/bin/python bench/python/model_kinds.py [NAME-PART ...]
"""
import gc
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import memfit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_models import describe, plain, steps_peak  # noqa: E402
from unnamed_models import applied_peak  # noqa: E402

FRACTIONS = (0.6, 0.45, 0.3)
TOLERANCE = 0.03
MIB = 1 << 20


def encoder_decoder():
    model = nn.Transformer(d_model=128, nhead=4, num_encoder_layers=3, num_decoder_layers=3, dim_feedforward=512,
                           dropout=0.1, batch_first=True)
    embed, head = nn.Embedding(512, 128), nn.Linear(128, 512)

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.transformer, self.head = embed, model, head

        def forward(self, src, tgt):
            mask = self.transformer.generate_square_subsequent_mask(tgt.size(1))
            return self.head(self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask))

    src, tgt = torch.randint(0, 512, (16, 96)), torch.randint(0, 512, (16, 65))
    batch = {"src": src, "tgt": tgt}
    return Seq2Seq(), batch, lambda m, b: F.cross_entropy(m(b["src"], b["tgt"][:, :-1]).flatten(0, 1),
                                                         b["tgt"][:, 1:].flatten())


def seq2seq_batch(vocab, samples=16, source=96, target=64):
    """A source and target of token ids, some samples padded (the masks are real inputs)."""
    ids = torch.randint(4, vocab, (samples, source))
    mask = torch.ones_like(ids)
    mask[::4, -24:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(4, vocab, (samples, target))}


def hf_bart():
    """Hugging Face's BART from a small config, its cache on (the config's default): each decoder
    block reads the encoder's output and appends to the decoder's cache."""
    from transformers import BartConfig, BartForConditionalGeneration
    config = BartConfig(vocab_size=2048, d_model=128, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=128)
    return BartForConditionalGeneration(config), seq2seq_batch(config.vocab_size), lambda m, b: m(**b).loss


def hf_t5():
    """Hugging Face's T5 from a small config: the first block of each stack makes the relative
    position bias that every later block of the stack reads."""
    from transformers import T5Config, T5ForConditionalGeneration
    config = T5Config(vocab_size=2048, d_model=128, d_kv=32, d_ff=512, num_layers=3, num_decoder_layers=3,
                      num_heads=4, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config), seq2seq_batch(config.vocab_size), lambda m, b: m(**b).loss


class Down(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    def forward(self, x):
        return self.conv(x)


class Up(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = Down(2 * cout, cout)

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, widths=(16, 32, 64, 128), classes=4):
        super().__init__()
        self.downs = nn.ModuleList([Down(3 if i == 0 else widths[i - 1], w) for i, w in enumerate(widths)])
        self.ups = nn.ModuleList([Up(widths[i], widths[i - 1]) for i in range(len(widths) - 1, 0, -1)])
        self.out = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        skips = []
        for i, down in enumerate(self.downs):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, skip in zip(self.ups, reversed(skips[:-1])):
            x = up(x, skip)
        return self.out(x)


def unet():
    batch = (torch.randn(8, 3, 96, 96), torch.randint(0, 4, (8, 96, 96)))
    return UNet(), batch, lambda m, b: F.cross_entropy(m(b[0]), b[1])


def densenet():
    import torchvision
    model = torchvision.models.DenseNet(growth_rate=16, block_config=(4, 4, 4), num_init_features=32, num_classes=10)
    batch = (torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,)))
    return model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1])


class RecurrentLM(nn.Module):
    def __init__(self, vocab=1024, width=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


def lstm():
    ids = torch.randint(0, 1024, (32, 129))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    return RecurrentLM(), batch, lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())


def distinct_mlp():
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.LayerNorm(1024), nn.Linear(1024, 512), nn.Tanh(),
                          nn.Linear(512, 2048), nn.SiLU(), nn.Dropout(0.1), nn.Linear(2048, 10))
    batch = (torch.randn(2048, 256), torch.randint(0, 10, (2048,)))
    return model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1])


MODELS = {
    "encoder-decoder transformer (nn.Transformer 3+3 layers, 16 x 96 -> 64)": encoder_decoder,
    "Hugging Face BART (3+3 layers, d 128, 16 x 96 -> 64, cache on)": hf_bart,
    "Hugging Face T5 (3+3 layers, d 128, 16 x 96 -> 64)": hf_t5,
    "U-Net (4 levels, batch 8, 96x96)": unet,
    "torchvision DenseNet (3 dense blocks, batch 32, 64x64)": densenet,
    "recurrent LM (embedding, 2-layer LSTM, head; batch 32 x 128)": lstm,
    "MLP of distinct layers (batch 2048)": distinct_mlp,
}


def row(label, make, fraction):
    """One budget's row, everything made afresh (and gone after)."""
    torch.manual_seed(0)
    model, batch, loss_fn = make()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plain_peak = steps_peak(plain(model, opt, loss_fn), batch, 1 << 40, steps=2)
    budget = int(plain_peak * fraction)
    offload = "auto" if fraction < 0.4 else "none"
    head = f"| {label} | {fraction:.0%} | {plain_peak / MIB:.1f} | {budget / MIB:.1f} |"
    try:
        plan = memfit.plan(model, opt, loss_fn, batch, budget, offload=offload, progress=False)
    except (memfit.BudgetError, ValueError) as e:
        return f"{head} none: {str(e).splitlines()[0]} | | | | NO |"
    step, measured, _ = applied_peak(model, opt, plan, batch, budget, peak_of=steps_peak)
    error = (measured - plan.predicted_peak_bytes) / plan.predicted_peak_bytes
    ok = "yes" if measured <= budget and abs(error) <= TOLERANCE and step.oom_splits == 0 else "NO"
    return (f"{head} {describe(plan)} | {plan.predicted_peak_bytes / MIB:.2f} | {measured / MIB:.2f} | {error:+.2%} | "
            f"{ok} |")


def main():
    names = sys.argv[1:]
    print(f"torch {torch.__version__}, memfit built for {memfit.built_torch_version()}, {torch.get_num_threads()} threads")
    print("command: OMP_WAIT_POLICY=passive python bench/python/model_kinds.py")
    print("| model | budget | plain peak MiB | budget MiB | plan | predicted MiB | measured MiB | error | fits, within 3%, no OOM |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    failed = 0
    for label, make in MODELS.items():
        if names and not any(n in label for n in names):
            continue
        for fraction in FRACTIONS:
            gc.collect()
            line = row(label, make, fraction)
            failed += line.endswith("NO |")
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
