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
        self._parameters = list(parameters)
        self._core = _C.OptimizerOffload(self._parameters)
        self.masters = self._core.host_parameters()
        _move_onto(optimizer, self._parameters, self.masters)

    def give_back(self, optimizer):
        """The reverse of the move (memfit.remove does this): ``optimizer``'s parameter groups hold
        the model's parameters again, and its state, keyed by them, is back where it keeps it for
        them (the moments on their device). The hooks streaming gradients to the host go with the
        C++ offload, and the masters are released: this offload is done."""
        _move_back(optimizer, self.masters, self._parameters)
        self._core = None  # its destructor removes the hooks from the parameters
        self.masters, self._parameters = [], []

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


def _move_back(optimizer, masters, parameters):
    parameter_of = {id(m): p for m, p in zip(masters, parameters)}
    for group in optimizer.param_groups:
        group["params"] = [parameter_of.get(id(m), m) for m in group["params"]]
    with torch.no_grad():
        for m, p in zip(masters, parameters):
            state = optimizer.state.pop(m, None)
            if state is not None:  # one parameter's state at a time: the host copy goes at once
                optimizer.state[p] = {k: _C.state_tensor_to_device(v, p) if torch.is_tensor(v) else v
                                      for k, v in state.items()}
            del state
