"""memfit.apply / memfit.remove: a plan run on the user's own model and optimizer."""
import contextlib
import weakref

import torch

from memfit import _batch, _calls
from memfit._budget import budget as budget_context
from memfit._cache_off import CacheOff
from memfit._checkpoint import Checkpointing
from memfit._compiled import check_not_compiled
from memfit._loader import load
from memfit._parts import autocast, scalar_loss
from memfit._plan import Plan
from memfit._offload import OptimizerOffload
from memfit._optim8bit import Adam8bit
from memfit._progress import Observer, note
from memfit._sizes import format_bytes

_C = load()

_applied = weakref.WeakKeyDictionary()  # model -> its Step


def _grad_scaler(precision, device):
    """PyTorch's GradScaler where fp16 needs one (CUDA), else None."""
    if precision != "fp16" or device.type != "cuda":
        return None
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()


class Step:
    """One optimizer step of a plan: ``step(batch) -> float`` (the loss, by value).

    Each call releases the gradients (``zero_grad(set_to_none=True)``), runs the batch in
    micro-batches (each loss weighted by its share of the samples, so the gradients are the
    whole batch's mean), under autocast at the plan's precision, with blocks checkpointed: the
    micro-batch and the blocks chosen for the batch's shape before it runs (``plan.micro_batch``
    and ``plan.checkpointed`` for the planned batch; ``step.last_choice`` says); then the optimizer steps (through PyTorch's
    GradScaler for fp16) and the gradients are released again.

    ``optimizer`` is the optimizer that steps: the user's own, or, where the plan keeps 8-bit
    state, a :class:`memfit.Adam8bit` over the same parameters that carries the user's
    optimizer's moments over (that optimizer's own state is released; save and load this one's
    ``state_dict``). Where the plan offloads the optimizer, the optimizer is moved onto fp32
    masters of its parameters on the host (``step.offload.masters``; its ``param_groups`` hold
    them): each gradient is streamed there as backward makes it, the step runs there, and the
    masters are copied back into the model's weights. memfit.remove(model) gives the user's
    optimizer its state back as torch keeps it, on the device.

    Each call runs under memfit.budget(``budget``): the plan's budget unless given. An
    out-of-memory error there is recovered by memfit's C++ policy (runtime/oom_recovery.h), as
    the C++ trainer recovers: the micro-batch is redone with every block recomputed, then split
    in two, and the whole step is redone where gradients of earlier micro-batches were mixed in;
    no sample is lost or counted twice. After a real one, later steps keep the smaller
    micro-batch (or every block recomputed).
    """

    def __init__(self, model, optimizer, plan, budget=None, observer=None):
        self.model, self.plan = model, plan
        self.loss_fn = plan._loss_fn
        self.device = plan.device
        self.precision = plan.precision
        self.micro_batch = plan.micro_batch
        self.budget = plan.budget_bytes if budget is None else budget
        self.observer = observer or Observer()
        self.oom_splits = 0
        self._parameters = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._users_optimizer = optimizer  # given its state back by remove()
        self.offload = self._offload(optimizer, plan)
        with _C.HostSpace() if self.offload else contextlib.nullcontext():  # an offloaded 8-bit state on the host
            self.optimizer = self._stepping_optimizer(optimizer, plan)
        self.scaler = _grad_scaler(self.precision, self.device)
        # Where the step's gradient sums are held: the parameters, or offloaded, their host masters.
        self._gradient_holders = self.offload.masters if self.offload else self._parameters
        self._steps = 0
        self._micro_batch_cap = None  # set by a real out-of-memory error: the recovery's micro-batch
        self.last_choice = None  # the last batch's plan by its shape (the C++ planner's dict)
        # Always installed: a micro-batch redone after an out-of-memory error recomputes every block.
        self.checkpointing = Checkpointing(plan._blocks, plan.segments, plan.never_recomputed)
        self._cache = CacheOff(model) if plan._cache_off else None
        self._intercept = _calls.Intercept(plan._blocks, self.checkpointing)
        for module in (b.first for b in plan._blocks):
            module.forward._memfit = True

    def _offload(self, optimizer, plan):
        if not plan.optimizer_offloaded:
            return None
        note(self.observer, f"the plan offloads the optimizer: the {type(optimizer).__name__}'s state, its step and "
                            "fp32 masters of the weights are on the host (step.offload)")
        return OptimizerOffload(self._parameters, optimizer)

    def _stepping_optimizer(self, optimizer, plan):
        if plan.optimizer_state != "8bit" or isinstance(optimizer, Adam8bit):
            return optimizer
        had_state = any(optimizer.state.values())
        carried = Adam8bit.from_optimizer(optimizer)
        note(self.observer, f"the plan keeps Adam's state in 8 bits: memfit.Adam8bit (step.optimizer) steps from now on"
                            + (f", its moments carried over from the {type(optimizer).__name__}, whose own state is "
                               "released" if had_state else ""))
        return carried

    def __call__(self, batch):
        """Runs one optimizer step on `batch` under the budget; returns its loss (mean over the samples) as a float."""
        self._check_applied()
        with budget_context(self.budget, self.device), self._released_on_failure():
            return self._step(batch)

    def _step_recovering(self, batch, budget_bytes):
        """A step whose out-of-memory errors are recovered (the caller holds the budget)."""
        saved, self.budget = self.budget, budget_bytes
        try:
            with self._released_on_failure():
                return self._step(batch)
        finally:
            self.budget = saved

    def _check_applied(self):
        if self._intercept is None:
            raise RuntimeError("step: its plan was taken off the model by memfit.remove(model); expected the step of "
                               "an applied plan (memfit.apply again)")

    @contextlib.contextmanager
    def _released_on_failure(self):
        """A step that raises leaves nothing it made behind: its gradients (partial sums), the
        device gradients an offload had still to release, a segment's recording; the error
        reaches the caller as it was."""
        try:
            yield
        except BaseException:
            self.checkpointing.drop_unfinished()
            if self.offload is not None:
                self.offload.release_device_gradients()
            for p in self._parameters + list(self._gradient_holders):
                p.grad = None
            raise

    def gradients(self, batch):
        """Forward and backward of the plan on `batch`, leaving the gradients (no optimizer step):
        to compare them with a plain step's, or to clip them (offloaded: on ``step.offload.masters``).
        Returns the loss."""
        self._check_applied()
        self.optimizer.zero_grad(set_to_none=True)
        with self._released_on_failure():
            return self._accumulate(batch)

    def _step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._accumulate(batch)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.offload is not None:
            self.offload.step(self.optimizer.step)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _accumulate(self, batch):
        """The micro-batch loop (memfit's C++ one, runtime/step.h), its out-of-memory errors decided
        by memfit's C++ policy; each micro-batch run here."""
        samples = _batch.sample_count(batch)
        micro_batch, segments = self._planned_for(batch, samples)
        self.checkpointing.use(segments)
        recovery = _C.SplitRecovery(samples, len(self.plan._blocks), lambda text: note(self.observer, text))
        self._steps += 1
        recovery.begin_step(self._steps, segments, format_bytes(self.budget))

        def run(part):
            return self._micro_batch(_batch.narrow(batch, part.start, part.length), part.weight, part.recompute_all)

        # Offloaded, the device gradients backward left are released too where a micro-batch failed.
        also_released = self._parameters if self.offload is not None else []
        total, smallest = _C.accumulate_micro_batches(recovery, micro_batch, run,
                                                      list(self._gradient_holders), also_released, str(self.device))
        self.oom_splits += recovery.recoveries
        if recovery.real_oom_in_step:
            self.micro_batch, always = recovery.next_steps(micro_batch, smallest, self.checkpointing.recomputes_all())
            self.checkpointing.recompute_all = always
            self._micro_batch_cap = self.micro_batch
        return total

    def _planned_for(self, batch, samples):
        """(micro-batch, recomputed segments) for this batch, chosen from its shape before it runs
        by the C++ rule (plan/batch_shape.h): a longer batch split or recomputed more, a shorter one
        in fewer micro-batches. The plan's own where it has no rule (a plan given its segments) or
        nothing fits (the recovery then does what it can); after a real out-of-memory error, never
        more samples per micro-batch than the recovery left."""
        shapes = self.plan._shapes
        chosen = None
        if shapes is not None:
            length = self.plan._lengths.of(batch) if shapes.planned_length else 0
            chosen = shapes.choose(samples, length or 0)
            self.last_choice = chosen
            if not chosen["feasible"]:
                shape = f" x {length}" + (" pixels" if self.plan._lengths.unit == "pixels" else "") if length else ""
                note(self.observer, f"a batch of {samples} samples{shape} fits no plan under "
                                    f"{format_bytes(self.budget)}: it runs as planned, recovering as it must")
                chosen = None
        if chosen is None:
            micro_batch, segments = self.micro_batch, self.plan.segments
        else:
            micro_batch = chosen["micro_batch"]
            segments = [(first - 1, last - 1) for first, last in chosen["segments"]]
        if self._micro_batch_cap is not None:
            micro_batch = min(micro_batch, self._micro_batch_cap)
        return min(micro_batch, samples), segments

    def _micro_batch(self, micro, weight, recompute_all):
        """Forward + backward of one micro-batch, every block recomputed where the recovery says."""
        every_step = self.checkpointing.recompute_all  # set after a real out-of-memory error
        self.checkpointing.recompute_all = every_step or recompute_all
        try:
            return self._forward_backward(micro, weight)
        finally:
            self.checkpointing.recompute_all = every_step

    def _forward_backward(self, micro, weight):
        """Forward + backward of one micro-batch, its loss weighted by its share of the samples;
        returns the weighted loss. A trainer's integration runs the trainer's own step here."""
        with autocast(self.device, self.precision):
            loss = scalar_loss(self.loss_fn(self.model, micro))
        value = float(loss.detach())
        if weight != 1.0:
            loss = loss * weight
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        if self.offload is not None:
            self.offload.release_device_gradients()
        return value * weight

    def remove(self):
        """Takes the plan off the model (memfit.remove(model) does this): its wrappers, and what the
        plan took from the user's optimizer, given back as torch keeps it (see memfit.remove).
        The step then holds nothing of the model, its optimizer or its plan, and cannot run."""
        if self._intercept is None:
            return
        self._intercept.remove()
        self._intercept = None
        if self._cache is not None:
            self._cache.restore()
        self._give_optimizer_back()
        if _applied.get(self.model) is self:
            del _applied[self.model]
        self.model = self.plan = self.loss_fn = self.optimizer = self._users_optimizer = None
        self.offload = self.checkpointing = self.scaler = None
        self._parameters = self._gradient_holders = []

    def _give_optimizer_back(self):
        """8-bit moments back in fp32 (made in the host space while offloaded, where the 8-bit
        state was), then the offloaded state back on the device, keyed by the model's parameters."""
        users = self._users_optimizer
        if self.optimizer is not users:
            with _C.HostSpace() if self.offload else contextlib.nullcontext():
                self.optimizer.give_state_to(users)
        if self.offload is not None:
            self.offload.give_back(users)

    def __repr__(self):
        return f"memfit.Step({self.plan!r})" if self.plan is not None else "memfit.Step(removed)"


def _check_plan_fits_model(model, plan):
    check_not_compiled(model)  # compiled since it was planned
    if plan._model() is not model:
        raise ValueError("plan: it was made for another model (memfit.plan(model, ...) for this one)")
    ids = {id(m) for m in model.modules()}
    if not all(id(m) in ids for b in plan._blocks for m in b.modules):
        raise ValueError("plan: its blocks are no longer part of the model")


def apply(model, optimizer, plan, budget=None, progress=None):
    """Applies a plan to the user's own model and optimizer; returns ``step`` (see :class:`Step`).

    The model's blocks are wrapped (their ``forward``; memfit.remove(model) undoes it); the
    user's loop, DataLoader, logging and checkpoints stay theirs: call ``step(batch)`` once per
    optimizer step. Each step runs under memfit.budget(``budget``), by default the budget the
    plan was made for, and recovers from an out-of-memory error there (see :class:`Step`).
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model {type(model).__name__}: expected a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer {type(optimizer).__name__}: expected a torch.optim.Optimizer")
    if not isinstance(plan, Plan):
        raise ValueError(f"plan {type(plan).__name__}: expected the memfit.Plan that memfit.plan returned")
    _check_plan_fits_model(model, plan)
    if model in _applied or _calls.intercepted(model):
        raise ValueError("model: a plan is applied to it already (memfit.remove(model) first)")
    from memfit._progress import observer as make_observer
    step = Step(model, optimizer, plan, budget=budget, observer=make_observer(progress))
    _applied[model] = step
    return step


def remove(model):
    """Undoes memfit.apply on the model: its blocks run as before, and the user's optimizer has its
    state back as torch keeps it, so training goes on as if memfit had never been there: from a
    plan with 8-bit state, each parameter's step count and fp32 ``exp_avg``/``exp_avg_sq``
    dequantized from the 8-bit codes; from an offloaded plan, its parameter groups holding the
    model's parameters and its state on their device again. The step holds nothing after it.
    Returns whether a plan was applied."""
    step = _applied.get(model)
    if step is None:
        return False
    step.remove()
    return True
