"""The models the tests train: a GPT whose blocks sit in a ModuleList and take an attention
mask (Hugging Face's layout), a CNN with BatchNorm in residual blocks, and an MLP as an
nn.Sequential of Linear and ReLU layers. Small, but heavy in activations as real steps are."""
import math

import torch
from torch import nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, attention_mask):
        """The output, and the keys and values (views of qkv's output: a cache that keeps it)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        scores = scores + attention_mask
        weights = self.dropout(scores.softmax(dim=-1))
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d)), (k, v)


class GPTBlock(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, hidden_states, attention_mask=None, use_cache=False):
        a, present = self.attn(self.ln_1(hidden_states), attention_mask)
        hidden_states = hidden_states + a
        out = hidden_states + self.mlp(self.ln_2(hidden_states))
        return (out, present) if use_cache else (out,)  # a tuple, as Hugging Face's blocks


class GPT(nn.Module):
    """Embeddings, blocks in a ModuleList called with an attention mask, a final norm and a head.
    hf_like: as Hugging Face's GPT-2 in training, each block's keys and values returned with the
    output (alive until forward ends) and the head's weight tied to the embedding."""

    def __init__(self, vocab=256, d=64, heads=4, layers=6, seq=64, dropout=0.1, hf_like=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(GPTBlock(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.use_cache = hf_like
        if hf_like:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, attention_mask, labels=None):
        b, t = input_ids.shape
        x = self.wte(input_ids) + self.wpe(torch.arange(t, device=input_ids.device))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, -1e4)
        presents = []
        for block in self.h:
            out = block(x, attention_mask=mask, use_cache=self.use_cache)
            x = out[0]
            presents += out[1:]
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        return {"loss": loss, "logits": logits, "past_key_values": presents}


def gpt_batch(batch=16, seq=64, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[::3, -5:] = 0
    return {"input_ids": ids[:, :-1].contiguous(), "attention_mask": mask, "labels": ids[:, 1:].contiguous()}


def gpt_loss(model, batch):
    return model(**batch)["loss"]


class ResidualBlock(nn.Module):
    def __init__(self, channels, norm=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = norm(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class CNN(nn.Module):
    """`norm(channels)` makes each normalization layer (a per-sample one, as GroupNorm, makes the
    gradient of micro-batches the whole batch's)."""

    def __init__(self, channels=16, blocks=4, classes=10, norm=nn.BatchNorm2d):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), norm(channels), nn.ReLU())
        self.layers = nn.Sequential(*[ResidualBlock(channels, norm) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def cnn_batch(batch=16, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)


def cnn_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def mlp(width=256, layers=6, inputs=64, outputs=8):
    parts = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(layers - 2):
        parts += [nn.Linear(width, width), nn.ReLU()]
    parts.append(nn.Linear(width, outputs))
    return nn.Sequential(*parts)


def mlp_batch(batch=2048, inputs=64, outputs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, inputs, generator=g)
    return x, x[:, :outputs] * 2 + 0.5


def mlp_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


class RecurrentLM(nn.Module):
    """An embedding, a 2-layer LSTM and a linear head: no module repeated, so memfit plans the
    modules it runs in the order it runs them. Registered head first: only the forward says
    which runs when."""

    def __init__(self, vocab=256, width=192):
        super().__init__()
        self.head = nn.Linear(width, vocab)
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, num_layers=2, batch_first=True)

    def forward(self, ids):
        h, _ = self.rnn(self.embed(ids))
        return self.head(h)


def lstm_loss(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


class UNet(nn.Module):
    """Down blocks whose outputs a later up block reads (skips), pooled between blocks, and up
    blocks that upsample and concatenate first: code between the blocks that saves tensors and
    keeps a block's output alive, whether or not the blocks are recomputed."""

    def __init__(self, widths=(8, 16, 32), classes=3):
        super().__init__()

        def convs(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())
        self.downs = nn.ModuleList([convs(3 if i == 0 else widths[i - 1], w) for i, w in enumerate(widths)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(widths[i], widths[i - 1], 2, stride=2)
                                  for i in range(len(widths) - 1, 0, -1)])
        self.up_convs = nn.ModuleList([convs(2 * widths[i - 1], widths[i - 1]) for i in range(len(widths) - 1, 0, -1)])
        self.out = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        skips = []
        for i, down in enumerate(self.downs):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips[:-1])):
            x = conv(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def unet_batch(batch=8, size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 3, (batch, size, size), generator=g)


class Seq2Seq(nn.Module):
    """An encoder-decoder of PyTorch's layers: every decoder layer reads the encoder's output, and
    the source and target have lengths of their own."""

    def __init__(self, vocab=256, d=64, layers=2, longest=256):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, d), nn.Embedding(longest, d)
        self.encoder = nn.ModuleList([nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
                                      for _ in range(layers)])
        self.decoder = nn.ModuleList([nn.TransformerDecoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
                                      for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def embedded(self, ids):
        return self.embed(ids) + self.position(torch.arange(ids.size(1), device=ids.device))

    def forward(self, src, tgt):
        memory = self.embedded(src)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.embedded(tgt)
        causal = torch.triu(torch.full((tgt.size(1), tgt.size(1)), float("-inf"), device=tgt.device), diagonal=1)
        for layer in self.decoder:
            x = layer(x, memory, tgt_mask=causal)
        return self.head(x)


def seq2seq_batch(batch=16, source=48, target=32, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"src": torch.randint(0, vocab, (batch, source), generator=g),
            "tgt": torch.randint(0, vocab, (batch, target + 1), generator=g)}


def seq2seq_loss(model, batch):
    logits = model(batch["src"], batch["tgt"][:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch["tgt"][:, 1:].flatten())


class BiasedBlock(nn.Module):
    """A T5-like block: the first of a stack makes an attention bias of [batch, heads, L, L] (a
    learned relative-position bias plus the padding mask) and every block hands it on to the next,
    which reads it: a tensor a block made, alive in later blocks' calls."""

    def __init__(self, d=64, heads=4, makes_bias=False, longest=128):
        super().__init__()
        self.heads, self.longest = heads, longest
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))
        self.relative = nn.Embedding(2 * longest - 1, heads) if makes_bias else None

    def forward(self, x, bias=None, mask=None):
        b, n, d = x.shape
        if self.relative is not None:
            pos = torch.arange(n, device=x.device)
            distance = pos[None, :] - pos[:, None] + self.longest - 1  # [L, L]
            bias = self.relative(distance).permute(2, 0, 1)[None] + mask[:, None, None, :]  # [B, H, L, L]
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) + bias
        x = x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x)), bias


class BiasedStack(nn.Module):
    def __init__(self, vocab=256, d=64, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([BiasedBlock(d, makes_bias=i == 0) for i in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, labels):
        mask = (1.0 - attention_mask.float()) * -1e4  # additive: padded keys
        x, bias = self.embed(input_ids), None
        for block in self.blocks:
            x, bias = block(x, bias=bias, mask=mask)
        return {"loss": F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())}


def make(name, seed=0):
    """(model, batch, loss_fn) for 'gpt', 'gpt_hf_like', 'cnn', 'mlp', 'lstm', 'unet' or 'biased', seeded."""
    torch.manual_seed(seed)
    if name == "gpt":
        return GPT(), gpt_batch(seed=seed), gpt_loss
    if name == "gpt_hf_like":
        return GPT(hf_like=True), gpt_batch(seed=seed), gpt_loss
    if name == "cnn":
        return CNN(), cnn_batch(seed=seed), cnn_loss
    if name == "mlp":
        return mlp(), mlp_batch(seed=seed), mlp_loss
    if name == "lstm":
        return RecurrentLM(), gpt_batch(seed=seed), lstm_loss
    if name == "unet":
        return UNet(), unet_batch(seed=seed), cnn_loss
    if name == "biased":
        return BiasedStack(), gpt_batch(batch=8, seed=seed), gpt_loss
    raise ValueError(name)
