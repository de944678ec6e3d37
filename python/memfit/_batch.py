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
    if isinstance(batch, torch.Tensor):
        return batch.narrow(0, start, length)
    if isinstance(batch, dict):
        return type(batch)((k, narrow(v, start, length)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(narrow(v, start, length) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(narrow(v, start, length) for v in batch)
    return batch


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


def length_of(batch):
    """The batch's length: dimension 1 of its token tensors (integer tensors of two or more
    dimensions: ids, masks, labels), which a DataLoader padding each batch to its longest
    sequence changes from batch to batch; None where it has none (only its samples vary)."""
    lengths = {t.shape[1] for t in tensors(batch) if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()}
    if len(lengths) > 1:
        raise ValueError(f"batch: its integer tensors have lengths {sorted(lengths)} along dimension 1; expected one "
                         "(token ids, masks and labels of one padded length)")
    return next(iter(lengths), None)


def narrow_length(batch, length, planned):
    """The batch cut to its first `length` positions: dimension 1 of every tensor of two or more
    dimensions whose dimension 1 is the batch's length `planned` (views)."""
    if isinstance(batch, torch.Tensor):
        return batch.narrow(1, 0, length) if batch.dim() >= 2 and batch.shape[1] == planned else batch
    if isinstance(batch, dict):
        return type(batch)((k, narrow_length(v, length, planned)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(narrow_length(v, length, planned) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(narrow_length(v, length, planned) for v in batch)
    return batch
