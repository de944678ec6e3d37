"""Tensor storages, as torch 1.13 and 2.x each name them: the unit the allocator counts."""
import torch


def storage(t):
    """The untyped storage under a tensor (2.x: untyped_storage; 1.13: storage)."""
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def storage_key(t):
    """What identifies a tensor's storage (its data pointer), or None for one without memory."""
    if t is None or t.device.type == "meta":
        return None
    ptr = storage(t).data_ptr()
    return ptr or None


def storage_bytes(t):
    """Bytes of the tensor's storage."""
    return storage(t).nbytes() if t is not None else 0


def unique_bytes(tensors):
    """Bytes of the storages of `tensors`, each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        key = storage_key(t)
        if key is not None and key not in seen:
            seen.add(key)
            total += storage_bytes(t)
    return total


def optimizer_state_tensors(optimizer):
    """Every tensor the optimizer keeps in its state (any torch.optim optimizer)."""
    out = []
    for state in optimizer.state.values():
        if isinstance(state, dict):
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out
