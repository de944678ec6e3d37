"""memfit.plan: the fastest configuration of the user's step that fits a budget."""
import gc
import json
import re
import weakref

import torch

from memfit import _batch, _blocks, _budget, _storage
from memfit._loader import load
from memfit._optimizer_costs import has_8bit_state, measure_optimizer, optimizer_family
from memfit._parts import ModuleParts
from memfit._progress import note, observer as make_observer
from memfit._sizes import format_bytes, parse_budget
from memfit._state import ModelState

_C = load()

_PRECISIONS = ("fp32", "bf16", "fp16")

# The C++ core's notes quote its options in backquotes; here they read as plan()'s arguments.
_ARGUMENTS = ((re.compile(r"`precision` (\w+)"), r"precisions=('\1',)"),
              (re.compile(r"`optimizer\.state` (\w+)"), r"optimizer_state='\1'"),
              (re.compile(r"`blocks`"), "blocks="))


def _in_python_terms(text):
    for cpp, python in _ARGUMENTS:
        text = cpp.sub(python, text)
    return text


class BudgetError(ValueError):
    """No configuration reaches the budget; ``floor_bytes`` is the smallest budget that works."""

    def __init__(self, budget_bytes, floor_bytes, offload_floor_bytes=None):
        self.budget_bytes, self.floor_bytes = budget_bytes, floor_bytes
        hint = ""
        if offload_floor_bytes is not None and offload_floor_bytes < floor_bytes:
            hint = f"; with offload='optimizer', {format_bytes(offload_floor_bytes)} ({offload_floor_bytes} bytes)"
        super().__init__(f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below what any plan needs: "
                         f"the smallest budget that works is {format_bytes(floor_bytes)} ({floor_bytes} bytes){hint}")


class Plan:
    """How a step runs under a budget, chosen by memfit's C++ planner from measured costs.

    ``micro_batch`` x ``accumulation`` (samples per forward + backward, and how many make the
    step), ``precision`` (``fp32``, or ``bf16``/``fp16`` under autocast), ``checkpointed`` (the
    names of the blocks recomputed in backward), ``optimizer_state`` (``fp32``, or ``8bit``:
    memfit's 8-bit Adam/AdamW state), ``optimizer_offloaded`` (the optimizer's state, its step
    and fp32 masters of the weights on the host: ``predicted_host_peak_bytes``),
    ``predicted_peak_bytes`` (what ``memfit.budget`` will count at the step's peak) and
    ``predicted_step_seconds``; ``notes`` say why. ``str(plan)`` reads
    as a table; ``to_json()`` gives every number.
    """

    def __init__(self, result, blocks, loss_fn, model, batch_size, device, planner):
        self._result = result
        self._planner = planner  # the C++ Planner that made it (its request, and the measured costs)
        self._profile = planner.profile()  # the measured costs (C++ WorkloadProfile) the plan was made from
        self._blocks = blocks
        self._loss_fn = loss_fn
        self._model = weakref.ref(model)
        self.batch_size = batch_size
        self.device = device
        self.budget_bytes = result["budget_bytes"]
        self.floor_bytes = result["floor_bytes"]
        self.micro_batch = result["micro_batch"]
        self.accumulation = result["accumulation"]
        self.precision = result["precision"]
        self.optimizer_state = result["optimizer_state"]
        self.optimizer_offloaded = result["optimizer_offloaded"]
        self.predicted_host_peak_bytes = result["predicted_host_peak_bytes"]
        self.predicted_peak_bytes = result["predicted_peak_bytes"]
        self.predicted_step_seconds = result["predicted_step_seconds"]
        self.plain_predicted_peak_bytes = result["plain_predicted_peak_bytes"]
        self.plain_predicted_step_seconds = result["plain_predicted_step_seconds"]
        self.notes = [_in_python_terms(n) for n in result["notes"]]
        # The chain's segments hold block indices from 1 (part 0 is the code before the blocks).
        self.segments = [(first - 1, last - 1) for first, last in result["segments"]]
        self.checkpointed = [blocks[i].name for first, last in self.segments for i in range(first, last + 1)]
        self.block_names = [b.name for b in blocks]

    def to_dict(self):
        """Every number of the plan, the C++ planner's own JSON under ``"planner"``, and the
        measured costs it was made from under ``"profile"`` (the CLI's profile cache form)."""
        return {
            "budget_bytes": self.budget_bytes, "floor_bytes": self.floor_bytes, "batch": self.batch_size,
            "micro_batch": self.micro_batch, "accumulation": self.accumulation, "precision": self.precision,
            "checkpointed": self.checkpointed, "segments": self.segments, "blocks": self.block_names,
            "optimizer_state": self.optimizer_state, "optimizer_offloaded": self.optimizer_offloaded,
            "predicted_host_peak_bytes": self.predicted_host_peak_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_seconds": self.predicted_step_seconds,
            "plain_predicted_peak_bytes": self.plain_predicted_peak_bytes,
            "plain_predicted_step_seconds": self.plain_predicted_step_seconds, "notes": self.notes,
            "planner": json.loads(self._result["json"]),
            "profile": json.loads(self._profile.to_json()),
        }

    def to_json(self):
        """The plan as JSON text (``to_dict()``)."""
        return json.dumps(self.to_dict())

    def recomputing(self, segments):
        """This plan (micro-batch, precision, optimizer state) with exactly ``segments``
        recomputed, its peak predicted by the same model: each segment a block name, or a
        (first, last) pair of names for consecutive blocks recomputed together (one saved input,
        one recompute); [] recomputes none. The budget is not checked (``predicted_peak_bytes``
        says what it needs)."""
        index = {name: i for i, name in enumerate(self.block_names)}
        chain = []
        for segment in segments:
            first, last = (segment, segment) if isinstance(segment, str) else tuple(segment)
            if first not in index or last not in index or index[last] < index[first]:
                raise ValueError(f"segments {segment!r}: expected a block name or a (first, last) pair of names in "
                                 f"order, from {self.block_names}")
            chain.append((index[first] + 1, index[last] + 1))  # the chain's part 0 is the code before the blocks
        chain.sort()
        result = self._planner.evaluate(self.micro_batch, self.precision, chain, self.budget_bytes, self.optimizer_state,
                                        self.optimizer_offloaded)
        return Plan(result, self._blocks, self._loss_fn, self._model(), self.batch_size, self.device, self._planner)

    def __str__(self):
        recomputed = ", ".join(self.checkpointed) if self.checkpointed else "none"
        ratio = self.predicted_step_seconds / self.plain_predicted_step_seconds if self.plain_predicted_step_seconds else 1
        rows = [
            ("micro-batch x accumulation", f"{self.micro_batch} x {self.accumulation}"),
            ("precision", self.precision),
            ("blocks recomputed", f"{len(self.checkpointed)} of {len(self.block_names)}: {recomputed}"),
            ("optimizer state", self.optimizer_state + (f", on the host (offloaded; host peak "
                                                         f"{format_bytes(self.predicted_host_peak_bytes)})"
                                                         if self.optimizer_offloaded else "")),
            ("predicted peak", f"{format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.budget_bytes)}"),
            ("predicted step", f"{self.predicted_step_seconds:.3f} s ({ratio:.2f}x the plain step)"),
        ]
        lines = [f"  {label:<28}{value}" for label, value in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "memfit plan\n" + "\n".join(lines)

    def __repr__(self):
        return (f"Plan(micro_batch={self.micro_batch}, accumulation={self.accumulation}, precision={self.precision!r}, "
                f"checkpointed={len(self.checkpointed)} blocks, optimizer_state={self.optimizer_state!r}, "
                f"predicted_peak_bytes={self.predicted_peak_bytes})")


def _check_arguments(model, optimizer, loss_fn):
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model {type(model).__name__}: expected a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer {type(optimizer).__name__}: expected a torch.optim.Optimizer")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn {loss_fn!r}: expected a function (model, batch) -> loss tensor")


def _precisions(precisions, device):
    if isinstance(precisions, str):
        precisions = (precisions,)
    chosen, notes = [], []
    for p in precisions:
        if p not in _PRECISIONS:
            raise ValueError(f"precisions {p!r}: expected a tuple of 'fp32', 'bf16', 'fp16'")
        ok, why = _C.precision_supported(p, device.type)
        if ok:
            chosen.append(p)
        else:
            notes.append(f"{p} not considered: {why}")
    if not chosen:
        raise ValueError(f"precisions {tuple(precisions)!r}: none runs on {device.type} ({'; '.join(notes)})")
    return chosen, notes


def _device_of(model, batch):
    param = next(model.parameters(), None)
    return param.device if param is not None else _batch.device_of(batch)


def resident_bytes(model, optimizer, batch, device):
    """Bytes the budget counts beside what the plan models: the allocator's total now, less the
    parameters, the batch, the optimizer state and gradients (which the step replaces). Negative
    when the model was made before ``import memfit`` (its storage is then not counted)."""
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
    else:
        allocated = _C.allocated_bytes()
    known = list(model.parameters()) + _batch.tensors(batch) + _storage.optimizer_state_tensors(optimizer)
    known += [p.grad for p in model.parameters() if p.grad is not None]
    return allocated - _storage.unique_bytes(known)


def _request(optimizer, samples, device, costs, resident, optimizer_state, micro_batch, margin, offload="none",
             host_budget=0):
    r = _C.RequestOptions()
    r.batch = samples
    r.micro_batch = micro_batch or 0
    r.device = device.type
    r.optimizer_family = optimizer_family(optimizer)
    r.optimizer_state = optimizer_state if len(costs) > 1 or optimizer_state != "auto" else "fp32"
    r.lr = float(optimizer.param_groups[0].get("lr", 1e-3))
    r.optimizer_costs = costs
    r.resident_bytes = resident
    r.outside_bytes = _budget.outside_bytes(device)  # a CUDA budget counts it too
    r.margin = margin
    r.offload = offload
    r.host_budget_bytes = host_budget
    return r


def _profile_options(obs, streamed):
    o = _C.ProfileOptions()
    o.streamed = streamed  # the optimizer may be offloaded: the streamed backward is measured too
    if hasattr(obs, "on_progress"):
        o.progress = obs.on_progress
    return o


def _check_offload(offload):
    if offload not in ("none", "optimizer", "auto"):
        raise ValueError(f"offload {offload!r}: expected 'none', 'optimizer' or 'auto' (activations stay on the device "
                         "from Python)")
    return offload


def _check_optimizer_state(optimizer, optimizer_state):
    """Whether the 8-bit state is a candidate; ValueError for a state this optimizer cannot have."""
    if optimizer_state not in ("auto", "fp32", "8bit"):
        raise ValueError(f"optimizer_state {optimizer_state!r}: expected 'auto', 'fp32' or '8bit'")
    if optimizer_state == "8bit" and not has_8bit_state(optimizer):
        raise ValueError(f"optimizer_state '8bit': applies to torch.optim.Adam and AdamW (without amsgrad), "
                         f"not {type(optimizer).__name__}")
    return optimizer_state != "fp32" and has_8bit_state(optimizer)


def _optimizer_costs(optimizer, tracker, optimizer_state, with_8bit):
    costs = measure_optimizer(optimizer, tracker, with_8bit)
    return costs[1:] if optimizer_state == "8bit" else costs


def plan(model, optimizer, loss_fn, batch, budget, blocks=None, precisions=("fp32", "bf16"), optimizer_state="auto",
         micro_batch=None, margin=0.03, offload="none", host_budget=None, progress=None):
    """Plans the fastest configuration of one training step that fits ``budget``.

    ``loss_fn(model, batch) -> loss`` says how a batch becomes a scalar loss (any forward
    signature works); ``batch`` is a tensor, or a tuple, list or dict of tensors with samples
    along dimension 0. ``blocks`` are what checkpointing may recompute: a module class, a
    predicate over modules, a list of modules, or None (the repeated module class with the
    most parameters inside a ModuleList or Sequential, e.g. a transformer's layers). memfit
    runs the step a few times (each part of the chain measured in place with exact allocator
    bytes, the plain step timed), measures the optimizer's state on copies, and the C++ planner
    searches micro-batch x accumulation, precision (``precisions``), which blocks to recompute
    and the optimizer state (``optimizer_state``: "auto" keeps fp32 unless memfit's 8-bit
    Adam/AdamW state lets a faster plan fit, or any plan at all). ``offload``: "none", "optimizer"
    (its state, its step and fp32 masters of the weights on the host, each gradient streamed
    there as backward makes it; ZeRO-Offload), or "auto" (the optimizer offloaded only where that
    fits when the device alone does not, or runs faster); ``host_budget`` caps the host bytes.

    The model, its gradients, buffers and the random generators are left as they were (also on
    Ctrl-C). Returns a :class:`Plan`; raises :class:`BudgetError` (naming the smallest budget
    that works) when nothing fits, and ValueError naming the argument for bad input.
    """
    _check_arguments(model, optimizer, loss_fn)
    budget_bytes = parse_budget(budget, "budget")
    samples = _batch.sample_count(batch)
    if micro_batch is not None and not (isinstance(micro_batch, int) and 1 <= micro_batch <= samples):
        raise ValueError(f"micro_batch {micro_batch!r}: expected None (planned) or 1 to the batch's {samples} samples")
    if not 0 <= margin < 0.5:
        raise ValueError(f"margin {margin!r}: expected a fraction of the budget from 0 to 0.5")
    found = _blocks.find_blocks(model, blocks)
    device = _device_of(model, batch)
    offload = _check_offload(offload)
    host_budget_bytes = 0 if host_budget is None else parse_budget(host_budget, "host_budget")
    chosen, notes = _precisions(precisions, device)
    if offload != "none" and "fp16" in chosen:  # GradScaler unscales on the device, the gradients are on the host
        chosen = [c for c in chosen if c != "fp16"]
        notes.append("fp16 not considered: its loss scaler needs the gradients on the device, offload puts them on the host")
        if not chosen:
            raise ValueError(f"precisions {tuple(precisions)!r}: fp16 cannot run with offload={offload!r} (its loss "
                             "scaler needs the gradients on the device); add 'fp32' or 'bf16'")
    with_8bit = _check_optimizer_state(optimizer, optimizer_state)
    if with_8bit:
        _C.make_dynamic_maps(str(device))  # constants for the process's life: resident from now on
    obs = make_observer(progress)
    state = ModelState(model, optimizer, device)
    tracker = _C.Tracker(str(device))
    try:
        gc.collect()  # tensors held only by unreachable cycles would count as resident, then be freed
        resident = resident_bytes(model, optimizer, batch, device)
        state.clear_gradients()
        install = _C.TrackerInstall(tracker)
        try:
            parts = ModuleParts(model, loss_fn, batch, found, device)
            try:
                profile = _C.profile_parts(parts, chosen, tracker, _profile_options(obs, streamed=offload != "none"))
            except ValueError as e:  # the blocks' order, said in the core's terms
                raise ValueError(_in_python_terms(str(e))) from None
            for text in profile.notes:
                note(obs, _in_python_terms(text))
            profile.notes = notes + list(profile.notes)
            costs = _optimizer_costs(optimizer, tracker, optimizer_state, with_8bit)
        finally:
            install.close()
        request = _request(optimizer, samples, device, costs, resident, optimizer_state, micro_batch, margin, offload,
                           host_budget_bytes)
        planner = _C.Planner(profile, request)
        result = _C.plan_timing_as_needed(planner, budget_bytes, parts)
        if not result["feasible"] and offload == "none":
            offloaded = _request(optimizer, samples, device, costs, resident, optimizer_state, micro_batch, margin,
                                 "optimizer", host_budget_bytes)
            offload_floor = _C.Planner(profile, offloaded).floor_bytes()
    finally:
        state.restore()
        obs.close()
    if not result["feasible"]:
        raise BudgetError(budget_bytes, result["floor_bytes"], offload_floor if offload == "none" else None)
    return Plan(result, found, loss_fn, model, samples, device, planner)
