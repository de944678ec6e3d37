"""memfit.Adam8bit: Adam/AdamW whose two moments are kept blockwise in 8 bits by memfit's C++
core (techniques/optimizer_8bit.h: 2048 values per block, an fp32 absmax each, dynamic maps;
Dettmers et al. 2021), about a quarter of fp32 state's bytes, as a torch.optim.Optimizer."""
import torch

from memfit._loader import load

_C = load()


class Adam8bit(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``) or AdamW with 8-bit state from memfit's C++ core.

    The math is AdamW's (bias correction, decoupled weight decay) on the dequantized moments,
    which are then quantized again; tensors under 4096 values keep fp32 moments, updated as torch
    1.13's AdamW does, bit for bit (2.x's rounds in another order). A parameter whose gradient holds inf or NaN is left untouched.
    ``state_dict()`` / ``load_state_dict()`` round-trip the 8-bit codes bit for bit; ``state``
    holds each parameter's step and tensors (``exp_avg_codes``, ``exp_avg_absmax``, ...).
    The step runs in C++ with the GIL released.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, decoupled_weight_decay=True):
        if not lr >= 0:
            raise ValueError(f"lr {lr!r}: expected a learning rate >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas {betas!r}: expected two values in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.decoupled_weight_decay = decoupled_weight_decay
        self._core = None

    @classmethod
    def from_optimizer(cls, optimizer):
        """An Adam8bit over the same parameters and hyperparameters as a torch.optim.Adam/AdamW,
        carrying its state over: each parameter's step count, and its two moments quantized as
        the 8-bit step stores them (kept fp32 under 4096 values). One parameter at a time, its
        fp32 moments leave ``optimizer`` as they are carried, so the two states never coexist in
        full: ``optimizer`` keeps its parameters and hyperparameters, its state is empty after,
        and the returned optimizer is the one that steps from now on."""
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise ValueError(f"optimizer {type(optimizer).__name__} with amsgrad: its max_exp_avg_sq has no 8-bit form")
        groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
                  for g in optimizer.param_groups]
        carried = cls(groups, decoupled_weight_decay=isinstance(optimizer, torch.optim.AdamW))
        core = carried._ensure_core()
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.pop(p, None)
                if state and "exp_avg" in state:
                    core.set_state_from_fp32(p, int(float(state["step"])), state["exp_avg"], state["exp_avg_sq"])
                del state  # the fp32 moments go now, before the next parameter's are carried
        carried._mirror_state()
        return carried

    def give_state_to(self, optimizer):
        """The reverse of :meth:`from_optimizer` (memfit.remove does this): ``optimizer``, the
        torch.optim.Adam/AdamW this one was made from, over the same parameters, gets each
        parameter's state as torch keeps it: the step count, and both moments in fp32,
        dequantized in C++ exactly as this optimizer's next step would read them. One parameter
        at a time, the 8-bit state leaves this optimizer as it is given, so the two states never
        coexist in full; this one is empty after. ``optimizer``'s hyperparameters stay its own."""
        core = self._ensure_core()
        for group in self.param_groups:
            for p in group["params"]:
                self.state.pop(p, None)
                taken = core.take_state_as_fp32(p)
                if taken is not None:
                    step, exp_avg, exp_avg_sq = taken
                    optimizer.state[p] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        _steps_as_torch_keeps_them(optimizer)

    @staticmethod
    def _group_options(group):
        return _C.Adam8bitGroupOptions(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                                       beta2=float(group["betas"][1]), eps=float(group["eps"]),
                                       weight_decay=float(group["weight_decay"]))

    def _ensure_core(self):
        if self._core is None:
            self._core = _C.Adam8bit([list(g["params"]) for g in self.param_groups],
                                     [self._group_options(g) for g in self.param_groups], self.decoupled_weight_decay)
        return self._core

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over the parameters' gradients (in C++); returns closure()'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        core = self._ensure_core()
        for i, group in enumerate(self.param_groups):
            core.set_group(i, self._group_options(group))
        core.step()
        self._mirror_state()
        return loss

    def _mirror_state(self):
        core = self._core
        for group in self.param_groups:
            for p in group["params"]:
                state = core.state(p)
                if state is not None:
                    self.state[p] = state

    def skipped_updates(self):
        """Parameter updates skipped for a non-finite gradient, since construction."""
        return self._core.skipped_updates() if self._core is not None else 0

    def load_state_dict(self, state_dict):
        """Loads a state_dict saved by an Adam8bit over the same parameters (bit-exact)."""
        super().load_state_dict(state_dict)
        core = self._ensure_core()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    # torch's load_state_dict casts each state tensor but the step to a floating parameter's
                    # dtype: the codes (integers, exact there) are made uint8 again.
                    tensors = {k: v.to(torch.uint8) if k.endswith("_codes") else v
                               for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"}
                    core.set_state(p, int(state["step"]), tensors)
        self._mirror_state()


def _steps_as_torch_keeps_them(optimizer):
    """Step counts given as numbers turned into what this torch's Adam/AdamW keeps (a tensor since
    torch 1.12; its dtype, shape and device by version and by ``capturable``/``fused``), by torch's
    own rule: the one load_state_dict applies, __setstate__. Empty entries go first (1.13's rule
    reads the first entry's step)."""
    for p in [p for p, state in optimizer.state.items() if not state]:
        del optimizer.state[p]
    optimizer.__setstate__({"state": optimizer.state, "param_groups": optimizer.param_groups})
