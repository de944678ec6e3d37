"""memfit inside Hugging Face's Trainer (transformers 4.40 to 5.x; TRL's trainers are Trainers).

    from memfit.integrations.transformers import fit
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate)
    fitted = fit(trainer, budget="2GiB")   # plans from one real batch of the collator
    trainer.train()                         # as before, each step under the budget

The plan in the Trainer's terms:

- The batch. A step's batch is what the Trainer's knobs make it, per_device_train_batch_size x
  gradient_accumulation_steps. The Trainer then loads it whole (accumulation 1) and memfit's step
  runs it as the plan's micro-batches: memfit accumulates, not the Trainer, because its recovery
  may redo micro-batches whose gradients were summed already, which the Trainer's loop has
  consumed. The samples, their order and the optimizer steps stay as they were.
- Each micro-batch runs the Trainer's own training_step (a subclass's too: its compute_loss, its
  backward), the loss weighted by the micro-batch's share of the samples; where the Trainer has
  divided the loss by the whole batch's label count already (num_items_in_batch), as it is.
- Precision: autocast at the plan's precision around compute_loss. A Trainer set to bf16 (or
  fp16) plans with that precision only.
- Recomputed blocks: memfit's checkpointing of exactly the plan's blocks, the model's key/value
  cache off (config.use_cache), as Hugging Face's checkpointing has it. Hugging Face's own
  gradient checkpointing recomputes every layer: args.gradient_checkpointing (transformers 5:
  activation_checkpointing) is turned off.
- 8-bit state: memfit.Adam8bit becomes trainer.optimizer (a scheduler given follows it).
  Offload: the optimizer steps on the host masters, and max_grad_norm clips their gradients
  (the logged grad_norm is theirs).
- The budget: each step, from on_step_begin to on_step_end (forward, backward, clipping, the
  optimizer step), under memfit.budget; an out-of-memory error in forward or backward is
  recovered as memfit.apply's step recovers it.
- The log: the plan when training begins (trainer.log), then at each logging step the highest
  step peak since the last one (memfit/peak_bytes) and the recoveries so far (memfit/oom_splits).
"""
import torch
import transformers

from memfit._apply import Step
from memfit._compiled import WHY, check_not_compiled
from memfit._parts import autocast
from memfit._plan import plan
from memfit._progress import note, observer as make_observer
from memfit._sizes import format_bytes, parse_budget
from memfit.integrations import _trainers


def fit(trainer, budget, blocks=None, precisions=None, optimizer_state="auto", offload="none", host_budget=None,
        progress=None):
    """Plans the Trainer's step for ``budget`` from one real batch of its collator, and puts the
    plan on the Trainer: call ``trainer.train()`` as before. Arguments as :func:`memfit.plan`
    (``precisions`` None: the Trainer's bf16/fp16 if it sets one, else memfit.plan's choice).
    Returns a :class:`TrainerFit` (``plan``, each step's ``peaks``, ``remove()``). Raises
    memfit.BudgetError when nothing fits, ValueError for a Trainer set up in a way memfit cannot
    plan (naming the setting)."""
    _check_trainer(trainer)
    budget_bytes = parse_budget(budget, "budget")
    obs = make_observer(progress)
    _trainers.check_not_applied(trainer.model, "trainer.model")
    args = trainer.args
    batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    batch = _real_batch(trainer, batch_size)
    optimizer = trainer.optimizer if trainer.optimizer is not None else trainer.create_optimizer()
    cache = _trainers.cache_off(trainer.model, obs)
    try:
        chosen = plan(trainer.model, optimizer, lambda model, b: trainer.compute_loss(model, b), batch, budget_bytes,
                      blocks=blocks, optimizer_state=optimizer_state, offload=offload, host_budget=host_budget,
                      progress=obs, **_precisions(args, precisions))
    except BaseException:
        cache.restore()
        raise
    del batch
    _load_whole_batch(trainer, batch_size, obs)
    _leave_recompute_to_memfit(trainer, obs)
    return TrainerFit(trainer, _TrainerStep(trainer, optimizer, chosen, budget_bytes, obs), cache, obs)


def _check_trainer(trainer):
    if not isinstance(trainer, transformers.Trainer):
        raise ValueError(f"trainer {type(trainer).__name__}: expected a transformers.Trainer (or a subclass, such as "
                         "TRL's trainers)")
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError("trainer: DeepSpeed or FSDP shards the step itself; expected a Trainer on one device")
    if args.world_size > 1 or args.n_gpu > 1:
        raise ValueError(f"trainer: {args.world_size} processes, {args.n_gpu} GPUs; expected a Trainer on one device")
    if args.auto_find_batch_size:
        raise ValueError("TrainingArguments auto_find_batch_size=True: memfit plans the batch instead; expected False")
    if args.torch_compile:
        raise ValueError(f"TrainingArguments torch_compile=True: expected False ({WHY})")
    check_not_compiled(trainer.model, "trainer.model")
    if _recomputes_layers(trainer.model):
        raise ValueError("trainer.model: Hugging Face's gradient checkpointing is on; memfit chooses the blocks to "
                         "recompute (model.gradient_checkpointing_disable() first)")
    if trainer.train_dataset is None:
        raise ValueError("trainer.train_dataset None: memfit plans from one real batch of it")


def _precisions(args, precisions):
    """plan()'s precisions: the Trainer's own where it autocasts (bf16=True, fp16=True), else as given."""
    own = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if own is None:
        return {} if precisions is None else {"precisions": precisions}
    given = (precisions,) if isinstance(precisions, str) else precisions
    if given is not None and tuple(given) != (own,):
        raise ValueError(f"precisions {precisions!r}: the Trainer runs {own} ({own}=True in its TrainingArguments); "
                         f"expected None or ('{own}',)")
    return {"precisions": (own,)}


def _real_batch(trainer, batch_size):
    """One batch of `batch_size` samples as the Trainer makes them: its sampler, its collator
    (columns the model does not take removed), on its device."""
    saved = trainer._train_batch_size
    trainer._train_batch_size = batch_size
    try:
        loader = trainer.get_train_dataloader()
        batch = _trainers.first_batch(loader)
    finally:
        trainer._train_batch_size = saved
    if hasattr(loader, "end"):  # accelerate's loader leaves the accelerator's gradient state at an iteration's end
        loader.end()
    return _trainers.plain_batch(trainer._prepare_inputs(batch))


def _load_whole_batch(trainer, batch_size, obs):
    args = trainer.args
    if args.gradient_accumulation_steps > 1:
        note(obs, f"the Trainer loads each step's {batch_size} samples at once (per_device_train_batch_size "
                  f"{args.per_device_train_batch_size} x gradient_accumulation_steps {args.gradient_accumulation_steps}); "
                  "memfit runs them as the plan's micro-batches")
    args.per_device_train_batch_size, args.gradient_accumulation_steps = batch_size, 1
    trainer._train_batch_size = args.train_batch_size
    if trainer.accelerator.gradient_accumulation_steps != 1:  # it divides each loss by its count (transformers < 4.46)
        trainer.accelerator.gradient_accumulation_steps = 1


def _recomputes_layers(model):
    """Whether Hugging Face's own checkpointing is on (transformers 5 names it activation checkpointing)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return getattr(model, name)
    return False


def _leave_recompute_to_memfit(trainer, obs):
    names = [n for n in ("activation_checkpointing", "gradient_checkpointing") if getattr(trainer.args, n, False)]
    for name in names:
        setattr(trainer.args, name, False)
    if names:
        note(obs, f"{names[0]} turned off: memfit recomputes the plan's blocks, not every layer")


def _stepping_optimizer(trainer, step, obs):
    """trainer.optimizer from now on. Offloaded, the gradients are on the host masters: the
    Trainer's clipping moves there (it would clip the model's, which are gone)."""
    if step.offload is None:
        return step.optimizer
    norm, trainer.args.max_grad_norm = trainer.args.max_grad_norm or 0.0, 0.0
    if norm:
        note(obs, f"max_grad_norm {norm} clips the gradients on the host masters, where offload puts them")
    return _trainers.HostStepping(step.optimizer, step.offload, norm)


def _loss_is_summed(trainer, num_items_in_batch):
    """Whether the Trainer's loss is a micro-batch's part of the whole batch's already: the
    model, or compute_loss_func, divides by the batch's label count (transformers 4.46+)."""
    explicit = getattr(trainer, "loss_is_scaled_for_ga", None)
    if explicit is not None:
        return explicit
    accepts = getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None
    return bool(accepts or getattr(trainer, "compute_loss_func", None) is not None)


class _TrainerStep(Step):
    """memfit's step whose micro-batches each run the Trainer's own training_step."""

    def __init__(self, trainer, optimizer, plan, budget, observer):
        super().__init__(trainer.model, optimizer, plan, budget=budget, observer=observer)
        self.trainer = trainer
        self.training_step = trainer.training_step  # bound now: the Trainer's (or its subclass's) own
        self.compute_loss = trainer.compute_loss
        self.arguments = ((), {})  # what the Trainer's loop passed after the batch (num_items_in_batch)

    def _forward_backward(self, micro, weight):
        args, kwargs = self.arguments
        num_items = args[0] if args else kwargs.get("num_items_in_batch")
        scale = 1.0 if _loss_is_summed(self.trainer, num_items) else weight
        with _trainers.instance_attribute(self.trainer, "compute_loss", self._scaled_compute_loss(scale)):
            loss = self.training_step(self.model, micro, *args, **kwargs)
        if self.offload is not None:
            self.offload.release_device_gradients()
        return float(loss)

    def _scaled_compute_loss(self, scale):
        def compute_loss(model, inputs, *args, **kwargs):
            with autocast(self.device, self.precision):
                out = self.compute_loss(model, inputs, *args, **kwargs)
            if scale == 1.0:
                return out
            return (out[0] * scale,) + tuple(out[1:]) if isinstance(out, tuple) else out * scale
        return compute_loss


class _StepBudgetCallback(transformers.TrainerCallback):
    """Each of the Trainer's steps under the budget, and the plan logged when training begins."""

    def __init__(self, fitted):
        self.fitted = fitted

    def on_train_begin(self, args, state, control, **kwargs):
        self.fitted.log_plan()

    def on_step_begin(self, args, state, control, **kwargs):
        self.fitted.budgets.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.fitted.budgets.end()

    def on_train_end(self, args, state, control, **kwargs):
        self.fitted.budgets.close()


class TrainerFit:
    """A plan put on a Trainer: ``plan`` (memfit.Plan), ``step`` (the memfit.Step its
    training_step runs: ``oom_splits``, ``optimizer``), ``peaks`` (each step's peak, the bytes
    memfit.budget counted), ``budget_bytes``; ``remove()`` takes memfit off the Trainer (its
    batch knobs keep the whole batch)."""

    def __init__(self, trainer, step, cache, observer):
        self.trainer, self.step, self.plan, self.cache = trainer, step, step.plan, cache
        self.budget_bytes = step.budget
        self.budgets = _trainers.StepBudgets(step.budget, step.device)
        self._own_log, self._own_train = trainer.log, trainer.train
        _trainers.register(trainer.model, step)
        self._stepping = _stepping_optimizer(trainer, step, observer)
        self._set_optimizer(self._stepping)
        self._callback = _StepBudgetCallback(self)
        trainer.add_callback(self._callback)
        trainer.training_step = self._training_step
        trainer.log = self._log
        trainer.train = self._train
        note(observer, f"the Trainer's steps run under {format_bytes(self.budget_bytes)}:\n{self.plan}")

    @property
    def peaks(self):
        return self.budgets.peaks

    def _set_optimizer(self, optimizer):
        old = self.trainer.optimizer
        schedulers = [self.trainer.lr_scheduler] if self.trainer.lr_scheduler is not None else []
        _trainers.follow_optimizer(schedulers, old, optimizer)
        self.trainer.optimizer = optimizer

    def _training_step(self, model, inputs, *args, **kwargs):
        self.step.arguments = (args, kwargs)
        loss = self.step.gradients(_trainers.plain_batch(inputs))
        return torch.tensor(loss, device=self.trainer.args.device)

    def _train(self, *args, **kwargs):
        try:
            return self._own_train(*args, **kwargs)
        finally:
            self.budgets.close()  # a run that failed inside a step leaves no budget behind

    def _log(self, logs, *args, **kwargs):
        peak = self.budgets.unreported_peak()
        if peak is not None:
            logs = {**logs, "memfit/peak_bytes": peak, "memfit/oom_splits": self.step.oom_splits}
        if "loss" in logs and getattr(self._stepping, "grad_norm", None) is not None:
            logs = {**logs, "grad_norm": self._stepping.grad_norm}  # offloaded: the masters' gradients, not the model's
        return self._own_log(logs, *args, **kwargs)

    def log_plan(self):
        self.trainer.log(_trainers.plan_summary(self.plan))

    def remove(self):
        """The Trainer's own training_step, log and train again, the model's blocks unwrapped and
        its cache as it was (trainer.optimizer stays the one that stepped: memfit.Adam8bit, where
        the plan chose it)."""
        for name in ("training_step", "log", "train"):
            self.trainer.__dict__.pop(name, None)
        self.trainer.remove_callback(self._callback)
        self.step.remove()
        self.cache.restore()
