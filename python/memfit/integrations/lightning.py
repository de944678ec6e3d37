"""memfit inside PyTorch Lightning (lightning 2.x): a Callback on the user's LightningModule.

    from memfit.integrations.lightning import MemfitCallback
    trainer = L.Trainer(max_steps=1000, callbacks=[MemfitCallback(budget="2GiB")])
    trainer.fit(module, datamodule)   # as before, each step under the budget

When training starts, the callback plans from the first batch of the module's own train
DataLoader (the batch its optimizer steps on), then runs each batch as memfit's step does:

- The batch as the plan's micro-batches, each through the module's own training_step, its loss
  weighted by the micro-batch's share of the samples: the gradients are the whole batch's. What
  training_step logs with self.log is logged once per batch, as the samples' weighted mean (a
  torchmetrics Metric as itself).
- Lightning then back-propagates the loss training_step returns: that loss hands Lightning the
  gradients the micro-batches made (Lightning zeroes gradients between training_step and
  backward), so its hooks, gradient clipping and optimizer step run as they do.
- Precision: autocast at the plan's precision. A Trainer at "bf16-mixed" plans bf16 only.
- Recomputed blocks: memfit's checkpointing of exactly the plan's blocks (the key/value cache of
  Hugging Face models inside turned off, as their own checkpointing does); 8-bit state:
  memfit.Adam8bit becomes the Trainer's optimizer, its schedulers following it; offload: the
  optimizer steps on the host masters (Lightning clips the optimizer's parameters: those).
- The budget: each batch, from on_train_batch_start to on_train_batch_end (the optimizer step
  included), under memfit.budget; an out-of-memory error in forward or backward is recovered as
  memfit.apply's step recovers it.
- The log: the plan as hyperparameters of the Trainer's loggers, each step's peak as
  ``memfit/peak_bytes`` and the recoveries as ``memfit/oom_splits``.
"""
import contextlib
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from memfit._apply import Step
from memfit._compiled import check_not_compiled
from memfit._plan import plan
from memfit._progress import note, observer as make_observer
from memfit._sizes import format_bytes, parse_budget
from memfit.integrations import _trainers

# What memfit plans for each of Lightning's precisions: its own autocast, or none.
_PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": ("bf16",)}


def _loss_of(output):
    """The loss a training_step returned (a tensor, or a mapping's "loss")."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"training_step returned {type(output).__name__}: expected the loss, a tensor or a dict "
                         "with 'loss' (memfit's callback runs automatic optimization)")
    return loss


class _MicroBatchLogs:
    """What training_step logs with self.log during a batch's micro-batches, logged once per
    batch: numbers and tensors as the samples' weighted mean, a Metric as itself."""

    def __init__(self, module):
        self.module = module
        self.kept = {}  # name -> ((value, weight) of each micro-batch, the last call's keyword arguments)
        self._pending = None

    @contextlib.contextmanager
    def micro_batch(self, weight):
        """Calls inside are this micro-batch's; kept only if it finishes (an out-of-memory error redoes it)."""
        self._pending = []
        try:
            yield
            for name, value, kwargs in self._pending:
                calls, _ = self.kept.get(name, ([], None))
                self.kept[name] = (calls + [(value, weight)], kwargs)
        finally:
            self._pending = None

    def log(self, name, value, **kwargs):
        if self._pending is None:  # outside a micro-batch (planning): nothing to log
            return
        self._pending.append((name, value.detach() if isinstance(value, torch.Tensor) else value, kwargs))

    @contextlib.contextmanager
    def collecting(self):
        with _trainers.instance_attribute(self.module, "log", self.log):
            yield

    def replay(self):
        kept, self.kept = self.kept, {}
        for name, (calls, kwargs) in kept.items():
            value = calls[-1][0]
            if isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
                value = sum(v * w for v, w in calls) / sum(w for _, w in calls)
            self.module.log(name, value, **kwargs)


class _ModuleStep(Step):
    """memfit's step whose micro-batches run the module's own training_step; self.log collected."""

    def __init__(self, module, optimizer, plan, budget, observer, logs):
        super().__init__(module, optimizer, plan, budget=budget, observer=observer)
        self.logs = logs

    def _forward_backward(self, micro, weight):
        # Lightning's precision plugin autocasts around training_step: backward runs outside it,
        # as Lightning runs it; the forward is autocast at the plan's precision.
        with self.logs.micro_batch(weight), torch.autocast(self.device.type, enabled=False):
            return super()._forward_backward(micro, weight)


class _MadeGradients(torch.autograd.Function):
    """The batch's loss; its backward puts back the gradients the micro-batches made, scaled as
    the loss was scaled (1 here: one batch per step, no loss scaler)."""

    @staticmethod
    def forward(ctx, anchor, loss, taken):
        ctx.taken = taken
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output):
        for holder, grad in ctx.taken:
            if not bool(grad_output == 1):
                grad.mul_(grad_output.to(grad.dtype))
            holder.grad = grad if holder.grad is None else holder.grad.add_(grad)
        ctx.taken = []
        return None, None, None


class MemfitCallback(pl.Callback):
    """Plans the LightningModule's step for ``budget`` when training starts, from the first
    batch of its train DataLoader, and runs each batch as memfit's step under the budget.
    Arguments as :func:`memfit.plan` (``precisions`` None: bf16 at "bf16-mixed", else
    memfit.plan's choice). After it started: ``plan``, ``step`` (memfit.Step: ``oom_splits``),
    ``peaks`` (each step's peak, the bytes memfit.budget counted). One device, one optimizer,
    automatic optimization, accumulate_grad_batches=1 (memfit accumulates: give the DataLoader
    the whole batch), precision "32-true" or "bf16-mixed"; otherwise ValueError names the setting."""

    def __init__(self, budget, blocks=None, precisions=None, optimizer_state="auto", offload="none", host_budget=None,
                 progress=None):
        self.budget_bytes = parse_budget(budget, "budget")
        self.options = dict(blocks=blocks, optimizer_state=optimizer_state, offload=offload, host_budget=host_budget)
        self.precisions = precisions
        self.observer = make_observer(progress)
        self.plan = self.step = self.budgets = None
        self._module = self._logs = self._cache = None
        self._arguments = ((), {})  # training_step's arguments after the batch (batch_idx, ...)

    @property
    def peaks(self):
        return self.budgets.peaks if self.budgets is not None else []

    def on_train_start(self, trainer, pl_module):
        _check_trainer(trainer, pl_module)
        _trainers.check_not_applied(pl_module, "the LightningModule")
        self._module, self._logs = pl_module, _MicroBatchLogs(pl_module)
        self._cache = _trainers.cache_off(pl_module, self.observer)
        self.plan = self._planned(trainer, pl_module)
        self.step = _ModuleStep(pl_module, trainer.optimizers[0], self.plan, self.budget_bytes, self.observer, self._logs)
        _trainers.register(pl_module, self.step)
        _set_optimizer(trainer, trainer.optimizers[0], _trainers.stepping_optimizer(self.step))
        self.budgets = _trainers.StepBudgets(self.budget_bytes, self.step.device)
        pl_module.training_step = self._training_step
        for logger in trainer.loggers:
            logger.log_hyperparams(_trainers.plan_summary(self.plan))
        note(self.observer, f"the Trainer's steps run under {format_bytes(self.budget_bytes)}:\n{self.plan}")

    def _planned(self, trainer, pl_module):
        """The plan of the module's step, from the first batch of its train DataLoader."""
        own_training_step = pl_module.training_step
        # Lightning passes batch_idx where the hook takes it: to this callback's, which takes any.
        self._takes_batch_idx = is_param_in_hook_signature(own_training_step, "batch_idx", min_args=2)
        self._arguments = ((0,) if self._takes_batch_idx else (), {})
        loss_fn = lambda module, batch: _loss_of(own_training_step(batch, *self._arguments[0], **self._arguments[1]))
        with self._logs.collecting():  # the profile's runs log nothing
            return plan(pl_module, trainer.optimizers[0], loss_fn, _first_batch(trainer), self.budget_bytes,
                        progress=self.observer, **self.options, **_precisions(trainer.precision, self.precisions))

    def _training_step(self, batch, *args, **kwargs):
        self._arguments = (args if self._takes_batch_idx else args[1:], kwargs)
        step = self.step
        with self._logs.collecting():
            value = step.gradients(_trainers.plain_batch(batch))
        self._logs.replay()
        taken = []
        for holder in step._gradient_holders:
            if holder.grad is not None:
                taken.append((holder, holder.grad))
                holder.grad = None  # Lightning zeroes the gradients before its backward
        anchor = torch.zeros((), requires_grad=True)
        return _MadeGradients.apply(anchor, torch.tensor(value, device=step.device), taken)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.budgets.begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.budgets.end()
        pl_module.log("memfit/peak_bytes", float(self.budgets.peaks[-1]), on_step=True, on_epoch=False)
        pl_module.log("memfit/oom_splits", float(self.step.oom_splits), on_step=True, on_epoch=False)

    def on_exception(self, trainer, pl_module, exception):
        self._close()

    def on_train_end(self, trainer, pl_module):
        self._close()

    def _close(self):
        """The budget closed and memfit taken off the module (its own training_step again)."""
        if self.budgets is not None:
            self.budgets.close()
        if self._module is not None:
            self._module.__dict__.pop("training_step", None)
            if self.step is not None:
                self.step.remove()
            self._cache.restore()
            self._module = None


def _check_trainer(trainer, pl_module):
    check_not_compiled(pl_module, "the LightningModule")
    if trainer.world_size > 1 or trainer.num_devices > 1:
        raise ValueError(f"Trainer devices: {trainer.num_devices} x {trainer.num_nodes} nodes; expected one device")
    if not pl_module.automatic_optimization:
        raise ValueError("automatic_optimization False: the module steps its optimizer itself; expected True")
    if len(trainer.optimizers) != 1:
        raise ValueError(f"configure_optimizers: {len(trainer.optimizers)} optimizers; expected one")
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(f"accumulate_grad_batches {trainer.accumulate_grad_batches}: memfit accumulates the plan's "
                         "micro-batches itself; expected 1, with the DataLoader giving the whole batch")
    if str(trainer.precision) not in _PRECISIONS:
        raise ValueError(f"precision {trainer.precision!r}: expected one of {', '.join(map(repr, _PRECISIONS))}")


def _precisions(lightning_precision, precisions):
    own = _PRECISIONS[str(lightning_precision)]
    if own is None:
        return {} if precisions is None else {"precisions": precisions}
    given = (precisions,) if isinstance(precisions, str) else precisions
    if given is not None and tuple(given) != own:
        raise ValueError(f"precisions {precisions!r}: the Trainer runs {lightning_precision!r}; expected None or {own!r}")
    return {"precisions": own}


def _first_batch(trainer):
    loader = trainer.train_dataloader
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ValueError(f"train dataloader {type(loader).__name__}: expected one torch DataLoader")
    return _trainers.plain_batch(trainer.strategy.batch_to_device(_trainers.first_batch(loader)))


def _set_optimizer(trainer, old, new):
    if new is old:
        return
    _trainers.follow_optimizer([c.scheduler for c in trainer.lr_scheduler_configs], old, new)
    trainer.optimizers = [new]
