"""What the integrations share: a real batch drawn without disturbing the run, a plan's step
registered on the model, Hugging Face models' cache off, the optimizer that steps handed to the
trainer's schedulers (on the host masters where the plan offloads it), and each training step
under the budget with its peak kept."""
import contextlib
import random
from collections.abc import Mapping

import torch

from memfit import _apply, _calls
from memfit._budget import budget as budget_context
from memfit._cache_off import NOTE as CACHE_NOTE, CacheOff
from memfit._progress import note

_MISSING = object()


@contextlib.contextmanager
def instance_attribute(obj, name, value):
    """obj.name is `value` inside the block (an instance attribute), as it was after."""
    saved = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, saved)


def check_not_applied(model, name):
    if model in _apply._applied or _calls.intercepted(model):
        raise ValueError(f"{name}: a plan is applied to it already (memfit.remove({name}) first)")


def register(model, step):
    """The step as memfit.apply's: memfit.remove(model) takes its wrappers off."""
    _apply._applied[model] = step


def cache_off(model, observer):
    """The models' key/value cache off while memfit trains them (memfit._cache_off), said."""
    cache = CacheOff(model)
    if cache.applies:
        note(observer, CACHE_NOTE)
    return cache


def plain_batch(batch):
    """A mapping the trainer hands over (Hugging Face's BatchEncoding is a UserDict) as a dict,
    the form memfit splits into micro-batches."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        return dict(batch)
    return batch


@contextlib.contextmanager
def random_state_kept(loader):
    """Drawing a batch may draw random numbers (a shuffling sampler, its own generator, a
    masking collator): they are taken back, so the run draws what it would have drawn."""
    state = random.getstate()
    generators = _generators(loader)
    states = [g.get_state() for g in generators]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(state)
            for g, saved in zip(generators, states):
                g.set_state(saved)


def _generators(loader):
    """The torch.Generators a DataLoader and its samplers shuffle with."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    found = {}
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator):
            found[id(generator)] = generator
    return list(found.values())


def first_batch(loader):
    """The loader's first batch, the random generators left as they were."""
    with random_state_kept(loader):
        iterator = iter(loader)
        try:
            return plain_batch(next(iterator))
        except StopIteration:
            raise ValueError("train_dataset: it yields no batch (memfit plans from one real batch)") from None
        finally:
            del iterator  # worker processes, if any, end here


def follow_optimizer(schedulers, old, new):
    """Learning-rate schedulers built over `old` drive `new` from now on (memfit.Adam8bit over
    the same parameters): its groups take the keys the schedulers keep there (initial_lr)."""
    if new is old:
        return
    for new_group, old_group in zip(new.param_groups, old.param_groups):
        for key, value in old_group.items():
            new_group.setdefault(key, value)
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new


class StepBudgets:
    """Each training step under memfit.budget(bytes): opened when the trainer begins a step,
    closed when it ends it; ``peaks`` holds each step's peak (the bytes the budget counted)."""

    def __init__(self, budget_bytes, device):
        self.budget_bytes, self.device = budget_bytes, device
        self.peaks = []
        self._open = None
        self._reported = 0

    def begin(self):
        self.close()
        self._open = budget_context(self.budget_bytes, self.device)
        self._open.__enter__()

    def end(self):
        if self._open is not None:
            self.peaks.append(self._exit())

    def close(self):
        """Closes the open budget, if any (the run ended or failed inside a step)."""
        if self._open is not None:
            self._exit()

    def _exit(self):
        opened, self._open = self._open, None
        opened.__exit__(None, None, None)
        return opened.peak_bytes

    def unreported_peak(self):
        """The highest peak of the steps ended since the last call, or None."""
        fresh = self.peaks[self._reported:]
        self._reported = len(self.peaks)
        return max(fresh) if fresh else None


def plan_summary(plan):
    """The plan as numbers a trainer's logger takes (its text form goes to the memfit logger)."""
    return {
        "memfit/budget_bytes": plan.budget_bytes,
        "memfit/predicted_peak_bytes": plan.predicted_peak_bytes,
        "memfit/micro_batch": plan.micro_batch,
        "memfit/accumulation": plan.accumulation,
        "memfit/precision_bf16": int(plan.precision == "bf16"),
        "memfit/blocks_recomputed": len(plan.checkpointed),
        "memfit/optimizer_state_8bit": int(plan.optimizer_state == "8bit"),
        "memfit/optimizer_offloaded": int(plan.optimizer_offloaded),
    }


class HostStepping(torch.optim.Optimizer):
    """The optimizer a trainer steps where the plan offloads it: memfit's step has moved the
    user's optimizer onto fp32 masters on the host (the gradients stream there in backward);
    its step runs there and copies the masters back into the weights. ``max_grad_norm``: the
    trainer's clipping, moved here to the masters' gradients, where offload put them;
    ``grad_norm``: their norm before the last step."""

    def __init__(self, optimizer, offload, max_grad_norm=0.0):
        super().__init__(optimizer.param_groups, optimizer.defaults)  # the same group dicts, shared
        self.optimizer, self.offload, self.max_grad_norm = optimizer, offload, max_grad_norm
        self.state = optimizer.state
        self.grad_norm = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning runs training_step and backward inside the step
            with torch.enable_grad():
                loss = closure()
        limit = self.max_grad_norm or float("inf")  # inf: the norm, nothing clipped
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.offload.masters, limit))
        self.offload.step(self.optimizer.step)
        return loss

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)  # new group dicts (accelerate's prepare does this): shared again
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state


def stepping_optimizer(step, max_grad_norm=0.0):
    """What the trainer steps: the step's optimizer, on the host masters where the plan offloads it."""
    if step.offload is None:
        return step.optimizer
    return HostStepping(step.optimizer, step.offload, max_grad_norm)
