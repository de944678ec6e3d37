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


def _is_token_tensor(t):
    """Token ids, masks and labels: integer tensors of two or more dimensions, their length along
    dimension 1 (a DataLoader padding each batch to its longest sequence changes it)."""
    return t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()


class Lengths:
    """The lengths of the planned batch, each token tensor's by where it is in the batch, and
    another batch's length as the plan's rule takes it (plan/batch_shape.h: one length, costs as
    functions of it). One length (a decoder's ids, mask and labels) is the batch's own. Several
    (an encoder-decoder's source and target) are one scale: the batch is planned as if each had
    grown as much as the one grown most from the planned batch (an upper bound where the costs
    grow with each), as `longest` (the planned batch's longest) times that growth."""

    def __init__(self, planned_batch):
        self.planned = {path: t.shape[1] for path, t in _tensors(planned_batch) if _is_token_tensor(t)}
        self.longest = max(self.planned.values(), default=None)

    def of(self, batch):
        """The batch's length on the planned batch's scale (None where the planned one has none)."""
        if self.longest is None:
            return None
        scaled = [-(-t.shape[1] * self.longest // self.planned[path])  # ceil, in integers
                  for path, t in _tensors(batch) if path in self.planned and t.dim() >= 2]
        return max(scaled, default=self.longest)

    def cut(self, batch, length):
        """The planned batch with every length scaled to `length` / `longest` (views): dimension 1
        of each tensor of two or more dimensions whose dimension 1 is one of the planned lengths."""
        to = {n: max(1, round(n * length / self.longest)) for n in self.planned.values()}

        def cut_one(t):
            return t.narrow(1, 0, to[t.shape[1]]) if t.dim() >= 2 and t.shape[1] in to else t
        return _map_tensors(batch, cut_one)


def _map_tensors(batch, fn):
    """The batch with `fn` applied to each tensor, its structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, _map_tensors(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch
