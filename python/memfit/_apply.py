"""memfit.apply / memfit.remove: a plan run on the user's own model and optimizer."""
import math
import weakref

import torch

from memfit import _batch, _calls
from memfit._budget import budget as budget_context
from memfit._checkpoint import Checkpointing
from memfit._loader import load
from memfit._measure import autocast, scalar_loss
from memfit._optim8bit import Adam8bit
from memfit._progress import Observer, note

_C = load()

_applied = weakref.WeakKeyDictionary()  # model -> its Step


def is_out_of_memory(error):
    """Whether an exception is an out-of-memory error (a GPU's, or memfit's budget on the CPU)."""
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(error, oom)) or (isinstance(error, RuntimeError) and "out of memory" in str(error))


def _grad_scaler(precision, device):
    """PyTorch's GradScaler where fp16 needs one (CUDA), else None."""
    if precision != "fp16" or device.type != "cuda":
        return None
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()


class _Split(Exception):
    """An out-of-memory error met in a micro-batch: whether it struck in backward (gradients touched)."""

    def __init__(self, in_backward):
        self.in_backward = in_backward


class Step:
    """One optimizer step of a plan: ``step(batch) -> float`` (the loss, by value).

    Each call releases the gradients (``zero_grad(set_to_none=True)``), runs the batch in
    micro-batches of ``plan.micro_batch`` samples (each loss weighted by its share of the
    samples, so the gradients are the whole batch's mean), under autocast at the plan's
    precision, with the plan's blocks checkpointed; then the optimizer steps (through PyTorch's
    GradScaler for fp16) and the gradients are released again. ``optimizer`` is the optimizer
    that steps: the user's own, or, where the plan chose 8-bit state, a :class:`memfit.Adam8bit`
    over the same parameters (save and load its ``state_dict``). With ``budget`` set (memfit.fit),
    each call runs under memfit.budget, and an out-of-memory error splits the micro-batch in two
    and redoes it (the whole step, from released gradients, when it struck in backward): no
    sample is lost or counted twice, and later steps keep the smaller micro-batch.
    """

    def __init__(self, model, optimizer, plan, budget=None, observer=None):
        self.model, self.plan = model, plan
        self.loss_fn = plan._loss_fn
        self.device = plan.device
        self.precision = plan.precision
        self.micro_batch = plan.micro_batch
        self.budget = budget
        self.observer = observer or Observer()
        self.oom_splits = 0
        eight_bit = plan.optimizer_state == "8bit" and not isinstance(optimizer, Adam8bit)
        self.optimizer = Adam8bit.from_optimizer(optimizer) if eight_bit else optimizer
        self.scaler = _grad_scaler(self.precision, self.device)
        self._intercept = None
        if plan.segments:
            self._intercept = _calls.Intercept(plan._blocks, Checkpointing(plan._blocks, plan.segments))
            for module in (b.first for b in plan._blocks):
                module.forward._memfit = True

    def __call__(self, batch):
        """Runs one optimizer step on `batch`; returns its loss (mean over the samples) as a float."""
        if self.budget is None:
            return self._step(batch)
        with budget_context(self.budget, self.device):
            return self._step_recovering(batch, self.budget)

    def _step_recovering(self, batch, budget_bytes):
        """A step whose out-of-memory errors split micro-batches (the caller holds the budget)."""
        saved, self.budget = self.budget, budget_bytes
        try:
            return self._step(batch)
        finally:
            self.budget = saved

    def gradients(self, batch):
        """Forward and backward of the plan on `batch`, leaving the gradients (no optimizer step):
        to compare them with a plain step's, or to clip them. Returns the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        return self._accumulate(batch)

    def _step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._accumulate(batch)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _accumulate(self, batch):
        samples = _batch.sample_count(batch)
        pending = self._chunks(0, samples)
        total = 0.0
        while pending:
            start, length = pending.pop(0)
            rng = _C.capture_rng(str(self.device))
            split = None
            try:
                total += self._micro_batch(_batch.narrow(batch, start, length), length / samples)
            except _Split as s:
                split = s
            if split is None:
                continue
            _C.restore_rng(rng)
            half = (length + 1) // 2
            self.micro_batch = min(self.micro_batch, half)
            self.oom_splits += 1
            if split.in_backward:  # partial sums were added: redo the whole step
                self.optimizer.zero_grad(set_to_none=True)
                total, pending = 0.0, self._chunks(0, samples)
                note(self.observer, f"out of memory in backward: the step is redone in micro-batches of {half}")
            else:
                pending = [(start, half), (start + half, length - half)] + pending
                note(self.observer, f"out of memory: micro-batch of {length} split in two ({half} + {length - half})")
        return total

    def _chunks(self, start, samples):
        m = self.micro_batch
        return [(s, min(m, samples - s)) for s in range(start, samples, m)]

    def _micro_batch(self, micro, share):
        """Forward + backward of one micro-batch; raises _Split on out-of-memory where recoverable."""
        in_backward = False
        try:
            with autocast(self.device, self.precision):
                loss = scalar_loss(self.loss_fn(self.model, micro))
            value = float(loss.detach())
            if share != 1.0:
                loss = loss * share
            if self.scaler is not None:
                loss = self.scaler.scale(loss)
            in_backward = True
            loss.backward()
            return value * share
        except RuntimeError as e:
            if self.budget is None or not is_out_of_memory(e) or _batch.sample_count(micro) < 2:
                raise
        raise _Split(in_backward)  # raised here, outside the handler: the failed graph is gone

    def remove(self):
        """Takes the plan's wrappers off the model (memfit.remove(model) does this)."""
        if self._intercept is not None:
            self._intercept.remove()
            self._intercept = None
        if _applied.get(self.model) is self:
            del _applied[self.model]

    def __repr__(self):
        return f"memfit.Step({self.plan!r})"


def _check_plan_fits_model(model, plan):
    if plan._model() is not model:
        raise ValueError("plan: it was made for another model (memfit.plan(model, ...) for this one)")
    ids = {id(m) for m in model.modules()}
    if not all(id(m) in ids for b in plan._blocks for m in b.modules):
        raise ValueError("plan: its blocks are no longer part of the model")


def apply(model, optimizer, plan, budget=None, progress=None):
    """Applies a plan to the user's own model and optimizer; returns ``step`` (see :class:`Step`).

    The planned blocks are wrapped (their ``forward``; memfit.remove(model) undoes it); the
    user's loop, DataLoader, logging and checkpoints stay theirs: call ``step(batch)`` once per
    optimizer step. ``budget`` (optional): each step runs under memfit.budget(budget), splitting
    a micro-batch that runs out of memory.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model {type(model).__name__}: expected a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer {type(optimizer).__name__}: expected a torch.optim.Optimizer")
    _check_plan_fits_model(model, plan)
    if model in _applied or _calls.intercepted(model):
        raise ValueError("model: a plan is applied to it already (memfit.remove(model) first)")
    from memfit._progress import observer as make_observer
    step = Step(model, optimizer, plan, budget=budget, observer=make_observer(progress))
    _applied[model] = step
    return step


def remove(model):
    """Undoes memfit.apply on the model: its blocks run as before. Returns whether a plan was applied."""
    step = _applied.get(model)
    if step is None:
        return False
    step.remove()
    return True
