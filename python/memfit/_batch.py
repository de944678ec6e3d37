"""A batch as the user gives it: a tensor, or a tuple, list or dict of them (nested), with its
samples along dimension 0. Micro-batches are views of it (no copy)."""
import torch

from memfit._storage import unique_bytes


def _tensors(batch, path="batch"):
    """(path, tensor) of every tensor in the batch."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, dict):
        for k, v in batch.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from _tensors(v, f"{path}[{i}]")


def tensors(batch):
    """Every tensor of the batch."""
    return [t for _, t in _tensors(batch)]


def sample_count(batch):
    """Samples in the batch (dimension 0 of every tensor); ValueError when they differ or none."""
    found = list(_tensors(batch))
    if not found:
        raise ValueError(f"batch {type(batch).__name__}: expected a tensor, or a tuple, list or dict of tensors "
                         "with samples along dimension 0")
    counts = {}
    for path, t in found:
        if t.dim() == 0:
            raise ValueError(f"batch: {path} is a 0-dimensional tensor; every tensor needs samples along dimension 0")
        counts.setdefault(t.shape[0], path)
    if len(counts) > 1:
        listed = ", ".join(f"{path} has {n}" for n, path in counts.items())
        raise ValueError(f"batch: tensors hold different sample counts along dimension 0 ({listed}); "
                         "every tensor needs the same")
    samples = next(iter(counts))
    if samples == 0:
        raise ValueError("batch: 0 samples along dimension 0; expected at least one")
    return samples


def narrow(batch, start, length):
    """Samples [start, start + length) of the batch, as views."""
    return _map_tensors(batch, lambda t: t.narrow(0, start, length))


def split(batch, micro_batch):
    """(micro-batch, its share of the samples) for each micro-batch of `micro_batch` samples."""
    n = sample_count(batch)
    out = []
    for start in range(0, n, micro_batch):
        length = min(micro_batch, n - start)
        out.append((narrow(batch, start, length), length / n))
    return out


def storage_bytes(batch):
    """Bytes of the batch's storages (each counted once)."""
    return unique_bytes(tensors(batch))


def device_of(batch):
    ts = tensors(batch)
    return ts[0].device if ts else torch.device("cpu")


def _sized_dims(t, with_tokens):
    """The dimensions a DataLoader may change between batches besides the samples: a sequence's
    tokens (integer ids, masks, labels of [B, L]; dimension 1), a segmentation mask's [B, H, W]
    (1 and 2) and an image's or a video's spatial ones (floating [B, C, H, W] or [B, C, T, H, W];
    2 on). In a batch `with_tokens` (integer [B, L] tensors) an integer tensor of more dimensions
    runs along the tokens (a layout model's [B, L, 4] boxes): dimension 1. None for features
    ([B, F]) and for a floating [B, L, D] or [B, C, T], whose length cannot be told from its shape."""
    if t.dim() < 2:
        return ()
    if t.is_floating_point() or t.is_complex():
        return tuple(range(2, t.dim())) if t.dim() >= 4 else ()
    return (1,) if with_tokens else tuple(range(1, t.dim()))


def _size_along(t, dims):
    size = 1
    for d in dims:
        size *= t.shape[d]
    return size


# A cut side keeps this much of its power-of-two divisibility: a U-Net pooled four times needs
# sides divisible by 16 for its skips to meet its upsampled maps again.
_KEPT_DIVISOR = 16


def _cut_side(n, factor):
    """Side `n` scaled by `factor`, a multiple of the power of two dividing `n` (up to 16)."""
    step = min(n & -n, _KEPT_DIVISOR)
    return max(step, round(n * factor / step) * step)


class Lengths:
    """The sizes of the planned batch that may change between batches (_sized_dims: a sequence's
    tokens, an image's pixels), each tensor's by where it is in the batch, and another batch's
    length as the plan's rule takes it (plan/batch_shape.h: one length, costs as functions of
    it). One size (a decoder's ids, mask and labels; an image and its mask) is the batch's own.
    Several (an encoder-decoder's source and target) are one scale: the batch is planned as if
    each had grown as much as the one grown most from the planned batch (an upper bound where the
    costs grow with each), as `longest` (the planned batch's largest size) times that growth.
    An image's size is its pixels: activations grow with them, a vision transformer's attention
    with their square, as a sequence's with its tokens."""

    def __init__(self, planned_batch):
        found = list(_tensors(planned_batch))
        with_tokens = any(t.dim() == 2 and not (t.is_floating_point() or t.is_complex()) for _, t in found)
        sized = {path: (_sized_dims(t, with_tokens), t) for path, t in found}
        self.planned = {path: (dims, _size_along(t, dims)) for path, (dims, t) in sized.items() if dims}
        self.longest = max((size for _, size in self.planned.values()), default=None)
        self.unit = "pixels" if any(len(dims) > 1 for dims, _ in self.planned.values()) else "long"

    def of(self, batch):
        """The batch's length on the planned batch's scale (None where the planned one has none)."""
        if self.longest is None:
            return None
        scaled = [-(-_size_along(t, self.planned[path][0]) * self.longest // self.planned[path][1])  # ceil
                  for path, t in _tensors(batch) if path in self.planned and t.dim() > max(self.planned[path][0])]
        return max(scaled, default=self.longest)

    def cut(self, batch, length):
        """The planned batch cut (views) to about `length` on its scale: each tensor's sized
        dimensions scaled by (length / longest) ** (1 / how many there are); an image's sides
        keep their power-of-two divisibility (up to 16), so `of` the result says where it landed."""
        ratio = length / self.longest
        # A tensor a sequence's length also runs along without telling it (a floating [B, L]
        # mask, [B, L, D] embeddings) is cut with it along dimension 1.
        tokens = {t.shape[1] for path, t in _tensors(batch) if len(self.planned.get(path, ((), 0))[0]) == 1}

        def cut_one(path, t):
            dims = self.planned[path][0] if path in self.planned else (1,) if t.dim() >= 2 and t.shape[1] in tokens else ()
            factor = ratio ** (1 / max(1, len(dims)))
            for d in dims:
                n = t.shape[d]
                t = t.narrow(d, 0, max(1, round(n * factor)) if len(dims) == 1 else _cut_side(n, factor))
            return t
        return _map_paths(batch, cut_one)


def _map_tensors(batch, fn):
    """The batch with `fn` applied to each tensor, its structure kept."""
    return _map_paths(batch, lambda _, t: fn(t))


def _map_paths(batch, fn, path="batch"):
    """The batch with `fn(path, tensor)` applied to each tensor (paths as _tensors names them)."""
    if isinstance(batch, torch.Tensor):
        return fn(path, batch)
    if isinstance(batch, dict):
        return type(batch)((k, _map_paths(v, fn, f"{path}[{k!r}]")) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_paths(v, fn, f"{path}[{i}]") for i, v in enumerate(batch)))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_paths(v, fn, f"{path}[{i}]") for i, v in enumerate(batch))
    return batch
