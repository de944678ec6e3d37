#!/usr/bin/python3
"""PyTorch twins of memfit's reference models, and a training-step benchmark for them.

Run with Debian's interpreter (it has python3-torch 1.13):

    /usr/bin/python3 bench/harness/pytorch_twin.py --model gpt --variant eager --threads 2 --steps 5 --json
    /usr/bin/python3 bench/harness/pytorch_twin.py --model cnn --params-only

Models (parameter counts equal memfit's C++ models, src/models/gpt.cpp and vision.cpp):
  gpt  [embed, attn0, mlp0, ..., attn{L-1}, mlp{L-1}, head], character level on the King James
       Bible text (`bible -f gen1:1-rev22:21`, verse reference dropped), vocabulary = its sorted
       distinct bytes; batches are random windows of the first 90% of the text.
  cnn  [stem, res0, ..., res{N-1}, head] on real Fashion-MNIST training images
       (/usr/share/datasets/fashion-mnist), normalized (x/255 - 0.2860) / 0.3530.

Variants: a configuration a PyTorch user can hand-pick, parts joined by "+", e.g.
"accum:4+ckpt_seq:3+autocast_bf16" (bench/harness/vs_pytorch.sh runs the grid of them):
  eager          plain forward/backward (alone: no other part).
  accum:K        gradient accumulation: the batch in K micro-batches of batch/K samples, each
                 loss divided by K and back-propagated before the next runs (K divides --batch).
  ckpt_seq:S     torch.utils.checkpoint.checkpoint_sequential over the blocks after the first one,
                 with S segments. In 1.13 it is reentrant: the segment input must require grad or
                 the segment's parameters get no gradients, so the first block (GPT: embed, which
                 takes integer token ids; CNN: stem) runs outside and its output feeds the rest.
                 The last segment is never checkpointed (PyTorch's rule). Every step asserts that
                 every parameter got a gradient.
  autocast_bf16  forward and loss under torch.autocast("cpu", dtype=torch.bfloat16), backward
                 outside it (as memfit does). LayerNorm inputs are brought back to fp32 first,
                 exactly like memfit's layer_norm_fp32 (1.13 CPU autocast cannot mix a bf16 input
                 with fp32 LayerNorm weights).
A variant the model cannot run (1.13's GroupNorm under CPU bf16 autocast) gives a row with
"error" (its first line) instead of times and bytes.

Every step: AdamW(lr 1e-3, foreach=False, like LibTorch's per-parameter loop), then
zero_grad(set_to_none=True) (memfit releases gradients after the optimizer step).

How peak_bytes is measured (exact, from the allocator):
  The legacy autograd profiler (torch.autograd.profiler_legacy, profile_memory=True) is switched
  on *before the model is built* and stays on through one warm-up step and the measured step.
  With memory profiling on, c10's CPU allocator (ProfiledCPUMemoryReporter, the same
  reportMemoryUsage hook memfit's tracker listens to) reports every allocation (+nbytes) and
  every free (-nbytes) as a 'memory_alloc' record into the per-thread record list, in the order
  they happen. Because recording starts before any parameter exists, the running sum of those
  records is exactly the number of live allocator bytes this process allocated since then
  (parameters, gradients, AdamW state, activations, temporaries, the batch); nothing is
  estimated. (Blocks allocated before recording starts are invisible at allocation and, by
  c10's design, also at free, so they never disturb the sum; the dataset is held in numpy
  arrays, outside the allocator, as memfit keeps its data sets outside the budget.)
  The measured step is wrapped in a RecordFunction scope "memfit_twin::measured_step" (opened with
  torch.ops.profiler._record_function_enter_new, which, unlike record_function's tensor handle,
  allocates nothing); its push/pop records bracket it in the main thread's list. baseline_bytes = running total at the push
  (what is live when the step starts: weights + AdamW state, gradients are None); peak_bytes =
  maximum of the running total between push and pop, i.e. baseline included. As a cross-check
  baseline_accounted_bytes sums the unique storages of parameters, gradients and optimizer state
  (1.13's AdamW keeps 'step' as a 4-byte tensor per parameter); it should equal baseline_bytes.
  Records from other threads (OpenMP workers; normally none allocate) would be merged by
  timestamp and counted in other_thread_memory_records.
  Step times are taken afterwards, on the same model, with the profiler off: one more warm-up
  step, then --steps timed steps (batch creation + forward + backward + optimizer step +
  zero_grad); median_step_s is their median, min_step_s their minimum. loadavg_1m (before,
  after) shows whether other work competed for the cores: with 2 OpenMP threads on 2 cores, one
  busy core stalls every parallel region and a step can take tens of times longer.
"""
import argparse
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import OrderedDict


def parse_variant(text):
    """{"accum": K, "segments": S (0: none), "bf16": bool} of a variant; ValueError if malformed."""
    parts = {"accum": 1, "segments": 0, "bf16": False}
    if text == "eager":
        return parts
    for part in text.split("+"):
        name, _, value = part.partition(":")
        if name in ("accum", "ckpt_seq") and value.isdigit() and int(value) >= 1:
            parts["accum" if name == "accum" else "segments"] = int(value)
        elif part == "autocast_bf16":
            parts["bf16"] = True
        else:
            raise ValueError("expected eager, or parts joined by + among accum:K, ckpt_seq:S (K, S >= 1) "
                             "and autocast_bf16; got %r" % part)
    return parts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["gpt", "cnn", "script"], required=True,
                   help="script: the user's model from --script/--data (see ScriptModel)")
    p.add_argument("--script", help="script: the TorchScript file memfit trains")
    p.add_argument("--data", help="script: torch.save({'inputs': X, 'targets': Y}) file")
    p.add_argument("--loss", default="cross-entropy", choices=["cross-entropy", "mse", "model"],
                   help="script: as memfit's --loss")
    p.add_argument("--eager", help="script: FILE.py:FUNCTION building the same model as Python "
                   "modules (eager); its weights are loaded from --script. Without it the "
                   "TorchScript file itself runs, from Python")
    p.add_argument("--layers", type=int, default=8, help="GPT transformer layers")
    p.add_argument("--d-model", type=int, default=256, help="GPT width")
    p.add_argument("--heads", type=int, default=8, help="GPT attention heads")
    p.add_argument("--seq", type=int, default=128, help="GPT sequence length")
    p.add_argument("--dropout", type=float, default=0.1, help="GPT dropout")
    p.add_argument("--vocab", type=int, default=0,
                   help="GPT vocabulary size; 0 (default): the KJV text's, and train on it; "
                        "N > 0: random tokens in [0, N)")
    p.add_argument("--blocks", type=int, default=6, help="CNN residual blocks")
    p.add_argument("--channels", type=int, default=32, help="CNN channels")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps before the measured step")
    p.add_argument("--variant", default="eager",
                   help="eager, or parts joined by +: accum:K, ckpt_seq:S, autocast_bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one compact JSON line")
    p.add_argument("--params-only", action="store_true", help="print only the parameter count")
    p.add_argument("--stream", action="store_true",
                   help="no profiler, no JSON: train --steps steps, printing 'step K SECONDS' after each, "
                        "flushed (bench/harness/lockstep.py times processes by these lines)")
    a = p.parse_args(argv)
    try:
        a.parts = parse_variant(a.variant)
    except ValueError as e:
        p.error("invalid --variant %r: %s" % (a.variant, e))
    if a.batch % a.parts["accum"]:
        p.error("invalid --variant %r: accum:%d must divide --batch %d" % (a.variant, a.parts["accum"], a.batch))
    for name in ("layers", "d_model", "heads", "seq", "blocks", "channels", "batch", "threads", "steps"):
        if getattr(a, name) < 1:
            p.error("invalid --%s %d: expected a positive integer" % (name.replace("_", "-"), getattr(a, name)))
    if a.model == "script" and not (a.script and a.data):
        p.error("--model script needs --script FILE and --data FILE")
    if a.d_model % a.heads:
        p.error("--heads %d must divide --d-model %d" % (a.heads, a.d_model))
    return a


if __name__ == "__main__":
    _ARGS = parse_args()
    # OpenBLAS (pthread build, Debian's system BLAS) has its own pool that torch.set_num_threads
    # does not size: set it before torch (and so libopenblas) is loaded.
    os.environ["OPENBLAS_NUM_THREADS"] = str(_ARGS.threads)
    os.environ["OMP_NUM_THREADS"] = str(_ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint_sequential  # noqa: E402

# ----------------------------------------------------------------------------- models


def layer_norm_fp32(ln, x):
    return ln(x if x.dtype == torch.float32 else x.float())


class Embed(nn.Module):
    def __init__(self, vocab, seq, d, p):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(seq, d)
        self.dropout = nn.Dropout(p)

    def forward(self, idx):  # [B, T] int64 -> [B, T, d]
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        return self.dropout(self.tokens(idx) + self.positions(pos))


class AttentionHalf(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_dropout = nn.Dropout(p)
        self.resid_dropout = nn.Dropout(p)

    def forward(self, x):  # [B, T, d] -> [B, T, d]
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(layer_norm_fp32(self.ln, x)).chunk(3, -1)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        q = q * (1.0 / math.sqrt(hd))
        scores = q @ k.transpose(-2, -1)  # [B, H, T, T]
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        att = self.attn_dropout(torch.softmax(scores, -1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return x + self.resid_dropout(self.proj(y))


class MlpHalf(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return x + self.dropout(self.out(F.gelu(self.fc(layer_norm_fp32(self.ln, x)))))


class Head(nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.logits = nn.Linear(d, vocab, bias=False)

    def forward(self, x):  # [B, T, V]
        return self.logits(layer_norm_fp32(self.ln, x))


def make_gpt(vocab, layers=8, d_model=256, heads=8, seq=128, dropout=0.1):
    blocks = OrderedDict(embed=Embed(vocab, seq, d_model, dropout))
    for i in range(layers):
        blocks["attn%d" % i] = AttentionHalf(d_model, heads, dropout)
        blocks["mlp%d" % i] = MlpHalf(d_model, dropout)
    blocks["head"] = Head(d_model, vocab)
    return nn.Sequential(blocks)


def gpt_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class Stem(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(1, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        g = math.gcd(c, 8)
        self.norm1 = nn.GroupNorm(g, c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = nn.GroupNorm(g, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        h = self.conv1(torch.relu(self.norm1(x)))
        return x + self.conv2(torch.relu(self.norm2(h)))


class PoolHead(nn.Module):
    def __init__(self, c, classes):
        super().__init__()
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(torch.relu(x).mean((2, 3)))


def make_cnn(blocks=6, channels=32, classes=10):
    mods = OrderedDict(stem=Stem(channels))
    for i in range(blocks):
        mods["res%d" % i] = Residual(channels)
    mods["head"] = PoolHead(channels, classes)
    return nn.Sequential(mods)


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())

# ----------------------------------------------------------------------------- data


def _text_cache_path():
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), "memfit-pytorch-twin", "kjv.txt")


def load_bible_text():
    """The KJV verse text as bytes: each line of `bible -f gen1:1-rev22:21` minus its first
    space-separated token, plus '\\n' (memfit's rule). Cached under /tmp."""
    path = _text_cache_path()
    if os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()
    raw = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], check=True, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL).stdout
    out = bytearray()
    for line in raw.split(b"\n"):
        space = line.find(b" ")
        if space < 0:
            continue
        out += line[space + 1:]
        out += b"\n"
    text = bytes(out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(text)
    os.replace(tmp, path)
    return text


class TextData:
    def __init__(self, seq, vocab_override, seed):
        self.seq = seq
        self.rng = np.random.default_rng(seed)
        if vocab_override > 0:
            self.vocab, self.n_chars, self.train = vocab_override, None, None
            return
        text = np.frombuffer(load_bible_text(), dtype=np.uint8)
        chars = np.unique(text)
        lut = np.zeros(256, dtype=np.uint8)
        lut[chars] = np.arange(len(chars), dtype=np.uint8)
        ids = lut[text]
        self.vocab, self.n_chars = len(chars), len(text)
        self.train = ids[: len(ids) - len(ids) // 10]

    def batch(self, b):
        """[B, T] int64 inputs and targets, allocated by torch (so counted, like memfit's)."""
        if self.train is None:
            w = self.rng.integers(0, self.vocab, size=(b, self.seq + 1))
        else:
            starts = self.rng.integers(0, len(self.train) - self.seq - 1, size=b)
            w = self.train[starts[:, None] + np.arange(self.seq + 1)[None, :]]
        w = torch.tensor(w, dtype=torch.long)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _read_idx(path):
    raw = gzip.open(path, "rb").read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


class FashionMnist:
    DIR = "/usr/share/datasets/fashion-mnist"

    def __init__(self, seed):
        self.images = _read_idx(os.path.join(self.DIR, "train-images-idx3-ubyte.gz"))
        self.labels = _read_idx(os.path.join(self.DIR, "train-labels-idx1-ubyte.gz"))
        self.rng = np.random.default_rng(seed)

    def batch(self, b):
        idx = self.rng.integers(0, len(self.images), size=b)
        x = torch.tensor(self.images[idx][:, None])  # uint8 [B, 1, 28, 28]
        x = (x.float() / 255.0 - 0.2860) / 0.3530
        return x, torch.tensor(self.labels[idx], dtype=torch.long)

class TensorData:
    """--model script: the samples of a torch.save({"inputs", "targets"}) file, held in numpy
    (outside the allocator, as memfit runs them outside the budget); the first 90% train, as
    memfit's held-out share of 0.1."""

    def __init__(self, path, seed):
        d = torch.load(path)
        n = d["inputs"].shape[0] - d["inputs"].shape[0] // 10
        self.inputs, self.targets = d["inputs"][:n].numpy().copy(), d["targets"][:n].numpy().copy()
        del d
        self.rng = np.random.default_rng(seed)

    def batch(self, b):
        idx = self.rng.integers(0, len(self.inputs), size=b)
        return torch.tensor(self.inputs[idx]), torch.tensor(self.targets[idx])


def load_script_model(args):
    """The user's model: the TorchScript file, or (--eager FILE.py:FUNCTION) the same model built
    as Python modules with the file's weights and buffers."""
    scripted = torch.jit.load(args.script)
    if not args.eager:
        return scripted
    import importlib.util
    path, func = args.eager.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("user_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = getattr(module, func)()
    model.load_state_dict(scripted.state_dict())
    return model


def script_loss(kind):
    if kind == "cross-entropy":
        return lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    if kind == "mse":
        return F.mse_loss
    return None  # "model": forward(inputs, targets) is the loss


# ----------------------------------------------------------------------------- training


class Trainer:
    def __init__(self, args):
        self.args = args
        torch.manual_seed(args.seed)
        if args.model == "gpt":
            self.data = TextData(args.seq, args.vocab, args.seed)
            self.model = make_gpt(self.data.vocab, args.layers, args.d_model, args.heads, args.seq,
                                  args.dropout)
            self.loss_fn = gpt_loss
        elif args.model == "script":
            self.data = TensorData(args.data, args.seed)
            self.model = load_script_model(args)
            self.loss_fn = script_loss(args.loss)
        else:
            self.data = FashionMnist(args.seed)
            self.model = make_cnn(args.blocks, args.channels)
            self.loss_fn = F.cross_entropy
        self.model.train()
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-3, foreach=False)
        self.segments = args.parts["segments"]
        self.accum = args.parts["accum"]
        self.bf16 = args.parts["bf16"]
        self.rest = self.model[1:] if self.segments else None  # the blocks after the first

    def forward_loss(self, x, y):
        if self.bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.forward_loss_fp32(x, y)
        return self.forward_loss_fp32(x, y)

    def forward_loss_fp32(self, x, y):
        if self.segments:
            h = self.model[0](x)  # requires grad: the reentrant checkpoint then back-props into it
            return self.loss_fn(checkpoint_sequential(self.rest, self.segments, h), y)
        if self.loss_fn is None:
            return self.model(x, y)
        return self.loss_fn(self.model(x), y)

    def step(self):
        x, y = self.data.batch(self.args.batch)
        value = 0.0
        for xs, ys in zip(x.chunk(self.accum), y.chunk(self.accum)):  # views: no copies
            loss = self.forward_loss(xs, ys) / self.accum
            value += loss.item()
            loss.backward()
            del loss
        del x, y, xs, ys
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        assert not missing, "parameters without gradients: %d of %d" % (len(missing), len(self.params))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return value

    def accounted_bytes(self):
        """Unique storages of parameters, gradients and optimizer state."""
        seen, total = set(), 0

        def add(t):
            nonlocal total
            if isinstance(t, torch.Tensor):
                s = t.storage()
                key = s.data_ptr()
                if key not in seen and s.nbytes() > 0:
                    seen.add(key)
                    total += s.nbytes()
        for p in self.params:
            add(p)
            add(p.grad)
        for state in self.opt.state.values():
            for t in state.values():
                add(t)
        return total


MARK = "memfit_twin::measured_step"


def measure(args):
    """Build, warm up and run one measured step under the legacy memory profiler; see the
    module docstring. Returns (trainer, info)."""
    import gc
    from torch.autograd import _disable_profiler_legacy, _enable_profiler_legacy
    from torch.autograd.profiler_legacy import profile as legacy_profile

    config = legacy_profile(profile_memory=True).config()
    _enable_profiler_legacy(config)
    try:
        trainer = Trainer(args)
        for _ in range(args.warmup):
            trainer.step()
        gc.collect()
        accounted = trainer.accounted_bytes()
        # A marker that allocates nothing itself (record_function's tensor handle would).
        handle = torch.ops.profiler._record_function_enter_new(MARK, None)
        loss = trainer.step()
        torch.ops.profiler._record_function_exit._RecordFunction(handle)
        del handle
    finally:
        thread_records = _disable_profiler_legacy()

    # Find the marker's thread and its push/pop.
    main, push_i, pop_i = None, None, None
    for ti, recs in enumerate(thread_records):
        for ri, r in enumerate(recs):
            if r.name() == MARK and r.kind() == "push":
                main, push_i, handle = ti, ri, r.handle()
            elif main == ti and r.kind() == "pop" and push_i is not None and r.handle() == handle:
                pop_i = ri
                break
        if pop_i is not None:
            break
    assert main is not None and pop_i is not None, "marker not found in the profile"
    start = thread_records[main][0]
    for recs in thread_records:
        for r in recs:
            if r.name() == "__start_profile":
                start = r

    # All memory records: (time, thread order, index, delta); the main thread's own order is exact.
    events, other = [], 0
    for ti, recs in enumerate(thread_records):
        for ri, r in enumerate(recs):
            if r.kind() == "memory_alloc" and r.cpu_memory_usage() != 0:
                events.append((start.cpu_elapsed_us(r), 0 if ti == main else 1, ti, ri, r.cpu_memory_usage()))
                if ti != main:
                    other += 1
    t_push = start.cpu_elapsed_us(thread_records[main][push_i])
    t_pop = start.cpu_elapsed_us(thread_records[main][pop_i])
    if other == 0:
        events.sort(key=lambda e: e[3])
    else:
        # Keep the main thread's order; slot other threads' records in by time.
        events.sort(key=lambda e: (e[0], e[1], e[2], e[3]))

    def in_step(e):
        if e[2] == main:
            return push_i < e[3] < pop_i
        return t_push <= e[0] <= t_pop

    running, baseline, peak, end, allocs = 0, None, None, None, 0
    for e in events:
        if baseline is None and in_step(e):
            baseline = running
            peak = running
        running += e[4]
        if baseline is not None and in_step(e):
            peak = max(peak, running)
            end = running
            allocs += e[4] > 0
    assert baseline is not None, "no allocation recorded in the measured step"
    return trainer, {
        "peak_bytes": peak,
        "baseline_bytes": baseline,
        "baseline_accounted_bytes": accounted,
        "end_bytes": end,
        "step_allocations": allocs,
        "other_thread_memory_records": other,
        "measured_loss": loss,
    }


def stream(args):
    """Train --steps steps without the profiler, one flushed line per finished step."""
    trainer = Trainer(args)
    for k in range(1, args.steps + 1):
        t0 = time.perf_counter()
        trainer.step()
        print("step %d %.6f" % (k, time.perf_counter() - t0), flush=True)
    return 0


def main(args):
    torch.set_num_threads(args.threads)
    if args.params_only:
        torch.manual_seed(args.seed)
        if args.model == "gpt":
            vocab = args.vocab if args.vocab > 0 else TextData(args.seq, 0, args.seed).vocab
            model = make_gpt(vocab, args.layers, args.d_model, args.heads, args.seq, args.dropout)
        else:
            model = make_cnn(args.blocks, args.channels)
        print(parameter_count(model))
        return 0
    if args.stream:
        return stream(args)

    load_before = os.getloadavg()[0]
    try:
        trainer, info = measure(args)
        trainer.step()  # warm-up without the profiler
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            trainer.step()
            times.append(time.perf_counter() - t0)
    except RuntimeError as e:  # a variant this model cannot run: a row that says so
        model = args.script if args.model == "script" else args.model
        print(json.dumps({"model": model, "variant": args.variant, "error": str(e).splitlines()[0],
                          "torch": torch.__version__}))
        return 0

    if args.model == "gpt":
        config = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
                  "dropout": args.dropout, "vocab": trainer.data.vocab,
                  "data": "random tokens" if args.vocab > 0 else
                  "KJV text, %d characters" % trainer.data.n_chars}
    elif args.model == "script":
        config = {"script": args.script, "data": args.data, "loss": args.loss,
                  "runs": "Python modules (eager, %s)" % args.eager if args.eager else "the TorchScript file"}
    else:
        config = {"blocks": args.blocks, "channels": args.channels, "data": "Fashion-MNIST train images"}
    config.update(batch=args.batch, threads=args.threads, optimizer="AdamW(lr=1e-3)")
    result = OrderedDict([
        ("model", args.script if args.model == "script" else args.model),
        ("parameters", parameter_count(trainer.model)),
        ("variant", args.variant),
        ("peak_bytes", info["peak_bytes"]),
        ("step_times_s", [round(t, 6) for t in times]),
        ("median_step_s", round(statistics.median(times), 6)),
        ("min_step_s", round(min(times), 6)),
        # Other work on the machine (e.g. compiles) inflates times badly with 2 OpenMP threads
        # on 2 cores: a descheduled worker stalls every parallel region. Recorded to judge that.
        ("loadavg_1m", [round(load_before, 2), round(os.getloadavg()[0], 2)]),
        ("baseline_bytes", info["baseline_bytes"]),
        ("baseline_accounted_bytes", info["baseline_accounted_bytes"]),
        ("end_bytes", info["end_bytes"]),
        ("step_allocations", info["step_allocations"]),
        ("other_thread_memory_records", info["other_thread_memory_records"]),
        ("measured_loss", round(info["measured_loss"], 6)),
        ("config", config),
        ("torch", torch.__version__),
    ])
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(_ARGS))
