"""The optimizer on the host for a Python optimizer (ZeRO-Offload; memfit's C++
runtime/optimizer_offload.h does the work).

    device:  weights W                      host:  masters W, their gradients, the state, the step

Each parameter's gradient is streamed to its fp32 master on the host as autograd finishes it,
so the device holds at most one parameter's gradient at a time; the user's optimizer, moved onto
the masters, steps there, and the masters are copied back into the model's weights.
"""
import torch

from memfit._loader import load

_C = load()


class OptimizerOffload:
    """Moves ``optimizer`` (built over ``parameters``) onto host masters of them: its parameter
    groups then hold the masters, and its state (if any) is moved to the host, keyed by them.
    The model keeps its parameters; ``step(fn)`` runs the optimizer's step on the host and
    copies the updated masters back."""

    def __init__(self, parameters, optimizer):
        self._core = _C.OptimizerOffload(list(parameters))
        self.masters = self._core.host_parameters()
        _move_onto(optimizer, list(parameters), self.masters)

    def release_device_gradients(self):
        """After a backward: the device gradients autograd still holds are released."""
        self._core.release_device_gradients()

    def step(self, optimizer_step):
        """``optimizer_step()`` on the host (its temporaries and new state there), then the weights."""
        self._core.step(optimizer_step)


def _move_onto(optimizer, parameters, masters):
    master_of = {id(p): m for p, m in zip(parameters, masters)}
    for group in optimizer.param_groups:
        group["params"] = [master_of.get(id(p), p) for p in group["params"]]
    with torch.no_grad():
        for p, m in zip(parameters, masters):
            state = optimizer.state.pop(p, None)
            if state is not None:  # one parameter's state at a time: the device copy goes at once
                optimizer.state[m] = {k: _C.copy_to_host(v) if torch.is_tensor(v) else v for k, v in state.items()}
            del state
