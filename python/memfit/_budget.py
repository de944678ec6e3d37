"""memfit.budget: a hard memory budget for the code inside it."""
import torch

from memfit._loader import load
from memfit._sizes import parse_budget

_C = load()


_outside = {}
_open = []  # the budgets entered and not yet exited, innermost last


def outside_bytes(device):
    """Memory a CUDA device's caching allocator does not hold (the context, cuBLAS's handle),
    measured once per device: a budget counts it, so the allocator's cap is the rest. 0 on the CPU."""
    if device.type != "cuda":
        return 0
    if device.index not in _outside:
        _outside[device.index] = _C.measure_outside_memory(device.index)["total"]
    return _outside[device.index]


def _device_of(device):
    if device is None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class budget:
    """A hard memory budget for the tensors allocated inside the ``with`` block.

    On the CPU (the default device) memfit's allocator, which replaces LibTorch's CPU allocator
    when memfit is imported, refuses any allocation that would take the live tensor bytes past
    ``size``: it raises the error a GPU out-of-memory raises (``torch.cuda.OutOfMemoryError``,
    a RuntimeError whose message contains "out of memory"), the failed step's tensors are freed as
    the exception unwinds, and the process goes on. Tensors made before ``import memfit`` are not
    counted. On a CUDA device the budget is the device's: the memory outside the caching allocator
    (the CUDA context, cuBLAS's handle) counts against it, and the allocator's memory fraction
    caps its reserved bytes at the rest, restored on exit.

    ``size``: bytes as an int, or a text such as ``"2GiB"``, ``"800MB"``, ``"1.5e9"``.

        with memfit.budget("2GiB"):
            loss = model(x).sum(); loss.backward()

    Budgets nest; each restores the one before it on exit. ``b.peak_bytes`` is the highest
    number of bytes the budget counted inside the block, inner budgets' blocks included (on CUDA
    the reserved bytes plus the memory outside the allocator).
    """

    def __init__(self, size, device=None):
        self.bytes = parse_budget(size, "budget")
        self.device = _device_of(device)
        self.peak_bytes = 0
        self._previous = None
        self._fraction = None
        self._peak_before = 0  # the peak the enclosing budget had counted when this one reset it

    def _device_peak(self):
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device) + outside_bytes(self.device)
        return _C.allocator_peak_bytes()

    def __enter__(self):
        cap = self.bytes - outside_bytes(self.device)
        if cap <= 0:
            raise ValueError(f"budget {self.bytes} bytes: expected more than the {outside_bytes(self.device)} bytes "
                             f"{self.device} holds outside its caching allocator (its context)")
        # Entering resets the device's peak: the enclosing budget keeps what it had counted.
        enclosing = [b for b in _open if b.device == self.device]
        if enclosing:
            enclosing[-1]._peak_before = max(enclosing[-1]._peak_before, self._device_peak())
        _open.append(self)
        if self.device.type == "cuda":
            self._fraction = _C.CudaMemoryFraction(cap, self.device.index)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        _C.install_budget_allocator()
        self._previous = _C.budget_bytes()
        _C.set_budget_bytes(self.bytes)
        _C.reset_allocator_peak()
        return self

    def __exit__(self, *exc):
        _open.remove(self)
        self.peak_bytes = max(self._peak_before, self._device_peak())
        if self._fraction is not None:
            self._fraction.close()
            self._fraction = None
            return False
        _C.set_budget_bytes(self._previous)
        return False


def allocated_bytes():
    """Bytes of CPU tensor storage memfit's allocator holds now (every tensor made since import)."""
    return _C.allocated_bytes()
