"""The model's state that measuring it disturbs, kept and put back: buffers (BatchNorm's running
statistics count every profiling run), the parameters' gradients, and the random generators
(dropout draws). Parameters are never changed by measuring."""
import torch

from memfit._loader import load

_C = load()


class ModelState:
    """What `restore()` puts back as it was when this was made."""

    def __init__(self, model, optimizer=None, device=torch.device("cpu")):
        self.model = model
        with torch.no_grad():
            self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        params = list(model.parameters())
        if optimizer is not None:
            known = {id(p) for p in params}
            params += [p for g in optimizer.param_groups for p in g["params"] if id(p) not in known]
        self.grads = [(p, p.grad) for p in params]
        self.training = [(m, m.training) for m in model.modules()]
        self.rng = _C.capture_rng(str(device))

    def clear_gradients(self):
        """Releases the gradients for the measurements (restore() puts them back)."""
        for p, _ in self.grads:
            p.grad = None

    def restore(self):
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g
        for m, training in self.training:
            m.training = training
        _C.restore_rng(self.rng)
