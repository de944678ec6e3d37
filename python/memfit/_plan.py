"""memfit.plan: the fastest configuration of the user's step that fits a budget."""
import gc
import json
import re
import weakref

import torch

from memfit import _batch, _blocks, _budget, _storage
from memfit._cache_off import NOTE as CACHE_NOTE, CacheOff
from memfit._loader import load
from memfit._optimizer_costs import has_8bit_state, measure_optimizer, optimizer_family
from memfit._parts import ModuleParts
from memfit._progress import note, observer as make_observer
from memfit._sizes import format_bytes, parse_budget
from memfit._state import ModelState

_C = load()

# The C++ core's notes quote its options in backquotes; here they read as plan()'s arguments.
_ARGUMENTS = ((re.compile(r"`precision` (\w+)"), r"precisions=('\1',)"),
              (re.compile(r"`optimizer\.state` (\w+)"), r"optimizer_state='\1'"),
              (re.compile(r"`offload` (\w+)"), r"offload='\1'"),
              (re.compile(r"`blocks`"), "blocks="))


def _in_python_terms(text):
    for cpp, python in _ARGUMENTS:
        text = cpp.sub(python, text)
    return text


class BudgetError(ValueError):
    """No configuration reaches the budget; ``floor_bytes`` is the smallest budget that works. The
    message (the C++ core's) names it, and what would go lower where the plan was not allowed it."""

    def __init__(self, budget_bytes, floor_bytes, text):
        self.budget_bytes, self.floor_bytes = budget_bytes, floor_bytes
        super().__init__(text)


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

    def __init__(self, result, blocks, loss_fn, model, batch_size, device, planner, cache_off=False, shapes=None):
        self._result = result
        # The C++ ShapePlanner (each batch planned by its shape, plan/batch_shape.h) and how a
        # batch's lengths are read (_batch.Lengths); None for a plan given its segments.
        self._shapes, self._lengths = shapes if shapes is not None else (None, None)
        self._cache_off = cache_off  # the model's own key/value cache is off while it trains (_cache_off.py)
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
        # Blocks whose forward changes state that outlives it: never recomputed, not even to recover.
        parts = self._profile.precisions[0].large.blocks
        self.never_recomputed = [i for i in range(len(blocks)) if not parts[i + 1].recomputable]

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
            "batches": self.batches(),
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
            stateful = [self.block_names[i] for i in range(index[first], index[last] + 1) if i in self.never_recomputed]
            if stateful:
                raise ValueError(f"segments {segment!r}: {stateful[0]} is never recomputed (its forward changes state "
                                 "that outlives it: the plan's notes say which)")
            chain.append((index[first] + 1, index[last] + 1))  # the chain's part 0 is the code before the blocks
        chain.sort()
        result = self._planner.evaluate(self.micro_batch, self.precision, chain, self.budget_bytes, self.optimizer_state,
                                        self.optimizer_offloaded)
        return Plan(result, self._blocks, self._loss_fn, self._model(), self.batch_size, self.device, self._planner,
                    self._cache_off)

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
        fits = self._batches_that_fit()
        if fits:
            rows.append(("batches that fit", fits))
        lines = [f"  {label:<28}{value}" for label, value in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "memfit plan\n" + "\n".join(lines)

    def batches(self):
        """What the budget takes, each batch planned by its shape before it runs (memfit's C++
        rule, plan/batch_shape.h): ``{"length": L0 (a sequence's tokens or an image's pixels,
        _batch.Lengths; None: the batch has no length, only its samples vary), "longest": the
        longest batch of the planned samples (-1: any searched, up to 64 x L0), "largest": the most samples at L0 (-1: any), "choices": the plan at
        half, once and twice L0}``; None for a plan given its segments."""
        shapes = self._shapes
        if shapes is None:
            return None
        length = shapes.planned_length or None
        lengths = [length // 2, length, 2 * length] if length else [0]
        return {"length": length, "longest": shapes.longest(self.batch_size) if length else None,
                "largest": shapes.largest(length or 0),
                "choices": [self._choice(self.batch_size, n) for n in lengths if n >= 1 or not length]}

    def _choice(self, samples, length):
        c = self._shapes.choose(samples, length)
        return {"samples": samples, "length": length or None, "feasible": c["feasible"], "micro_batch": c["micro_batch"],
                "accumulation": c["accumulation"], "recomputed": sum(last - first + 1 for first, last in c["segments"]),
                "predicted_peak_bytes": c["predicted_peak_bytes"]}

    def _batches_that_fit(self):
        b = self.batches()
        if b is None:
            return None
        def said(n, unit, any_text):
            return any_text if n < 0 else f"{n} {unit}"
        choices = "; ".join(
            f"{c['samples']} x {c['length']}: " + (f"{c['micro_batch']} x {c['accumulation']}, {c['recomputed']} recomputed"
                                                    if c["feasible"] else "none fits") for c in b["choices"] if c["length"])
        if b["length"] is None:
            return f"{said(b['largest'], 'samples', 'any number of samples')}, each planned by its samples before it runs"
        unit = self._lengths.unit  # "long" (a sequence's tokens) or "pixels" (an image's)
        return (f"{self.batch_size} samples up to {said(b['longest'], unit, 'any length')}, {b['length']} {unit} with "
                f"{said(b['largest'], 'samples', 'any number of samples')}; each planned before it runs ({choices})")

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
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    if not any(id(p) in trained for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(f"optimizer {type(optimizer).__name__}: holds none of the model's trainable parameters; "
                         "expected an optimizer over them")


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


def _profile_options(obs, streamed):
    o = _C.ProfileOptions()
    o.streamed = streamed  # the optimizer may be offloaded: the streamed backward is measured too
    if hasattr(obs, "on_progress"):
        o.progress = obs.on_progress
    return o


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
         micro_batch=None, margin=None, offload="none", host_budget=None, progress=None):
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
    ``margin``: the share of the budget kept free for what the measurements cannot see (None:
    the core's default, ``memfit.PLAN_MARGIN``).

    The model, its gradients, buffers and the random generators are left as they were (also on
    Ctrl-C). Returns a :class:`Plan`; raises :class:`BudgetError` (naming the smallest budget
    that works) when nothing fits, and ValueError naming the argument for bad input.
    """
    _check_arguments(model, optimizer, loss_fn)
    if blocks is not None:
        _blocks.find_blocks(model, blocks)  # a bad `blocks` is named before any work
    device = _device_of(model, batch)
    ask = _ask(optimizer, batch, device, budget, precisions, optimizer_state, micro_batch, margin, offload, host_budget)
    with_8bit = _check_optimizer_state(optimizer, optimizer_state)
    if with_8bit:
        _C.make_dynamic_maps(str(device))  # constants for the process's life: resident from now on
    obs = make_observer(progress)
    state = ModelState(model, optimizer, device)
    cache = CacheOff(model)  # measured as it will train
    cache_off = cache.applies
    if cache_off:
        note(obs, CACHE_NOTE)
    try:
        gc.collect()  # tensors held only by unreachable cycles would count as resident, then be freed
        ask.resident_bytes = resident_bytes(model, optimizer, batch, device)
        setup = _C.set_up_plan(ask)  # ValueError naming the first value not accepted
        state.clear_gradients()
        found = _blocks.find_blocks(model, blocks, probe=lambda: _probe_forward(model, loss_fn, batch))
        parts = ModuleParts(model, loss_fn, batch, found, device)
        profile, costs = _measure(parts, optimizer, setup, optimizer_state, with_8bit, obs, streamed=offload != "none")
        planner = _C.Planner(profile, setup.request(costs))
        result = _C.plan_timing_as_needed(planner, parts)
        if not result["feasible"]:
            raise BudgetError(ask.budget_bytes, result["floor_bytes"],
                              _in_python_terms(_C.below_floor_text(planner, ask.budget_bytes)))
        shapes = _shape_planner(planner, result, model, loss_fn, batch, found, device, obs)
    finally:
        cache.restore()
        state.restore()
        obs.close()
    return Plan(result, found, loss_fn, model, ask.batch, device, planner, cache_off, shapes)


def _shape_planner(planner, result, model, loss_fn, batch, found, device, obs):
    """The C++ rule that plans each batch by its shape (plan/batch_shape.h), and the batch's
    lengths (_batch.Lengths): the plan's precision profiled again on the batch cut to shorter
    lengths, where the batch has a length."""
    lengths = _batch.Lengths(batch)
    length = lengths.longest
    shorter = []
    if length is not None:
        tracker = _C.Tracker(str(device))
        try:
            landed = {length}
            for cut in _C.lengths_to_profile(length):
                shorter_batch = lengths.cut(batch, cut)
                at = lengths.of(shorter_batch)  # an image's sides are rounded: where the cut landed
                if at in landed:
                    continue
                landed.add(at)
                parts = ModuleParts(model, loss_fn, shorter_batch, found, device)
                options = _profile_options(obs, streamed=result["optimizer_offloaded"])
                profile = _C.profile_precision(parts, result["precision"], tracker, options)
                shorter.append(_C.LengthProfile(at, profile))
        except (RuntimeError, ValueError, IndexError) as e:  # a model that runs one length only
            note(obs, f"batches are planned by their samples only: the model did not run the batch cut to "
                      f"{cut} of its {length} {'pixels' if lengths.unit == 'pixels' else 'positions'} "
                      f"({type(e).__name__}: {str(e).splitlines()[0]})")
            length, shorter = None, []
    return _C.ShapePlanner(planner, result["json"], length or 0, shorter), lengths


def _probe_forward(model, loss_fn, batch):
    """One forward of two samples without a graph: which modules the model runs, in what order
    (plan() puts back the buffers and random state it changes)."""
    with torch.no_grad():
        loss_fn(model, _batch.narrow(batch, 0, min(2, _batch.sample_count(batch))))


def _ask(optimizer, batch, device, budget, precisions, optimizer_state, micro_batch, margin, offload, host_budget):
    """What plan() was asked, in the C++ core's terms (plan/plan_ask.h), which checks it."""
    ask = _C.PlanAsk()
    ask.budget_bytes = parse_budget(budget, "budget")
    ask.batch = _batch.sample_count(batch)
    ask.device = str(device)
    ask.precisions = [precisions] if isinstance(precisions, str) else list(precisions)
    if micro_batch is not None:
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
            raise ValueError(f"micro_batch {micro_batch!r}: expected None (planned) or 1 to the batch's {ask.batch} "
                             "samples")
        ask.micro_batch = micro_batch
    if margin is not None:
        ask.margin = margin
    ask.offload = offload
    if host_budget is not None:
        ask.host_budget_bytes = parse_budget(host_budget, "host_budget")
    ask.optimizer_family = optimizer_family(optimizer)
    ask.lr = float(optimizer.param_groups[0].get("lr", 1e-3))
    ask.outside_bytes = _budget.outside_bytes(device)  # a CUDA budget counts it too
    return ask


def _measure(parts, optimizer, setup, optimizer_state, with_8bit, obs, streamed):
    """The model's costs (the C++ profile of its parts) and the optimizer's, the tracker counting
    the model's device."""
    tracker = _C.Tracker(parts.device())
    for text in setup.notes:
        note(obs, _in_python_terms(text))
    try:
        profile = _C.profile_parts(parts, setup.precisions, tracker, _profile_options(obs, streamed))
    except ValueError as e:  # the blocks' order, said in the core's terms
        raise ValueError(_in_python_terms(str(e))) from None
    for text in profile.notes:
        note(obs, _in_python_terms(text))
    profile.notes = list(setup.notes) + list(profile.notes)
    install = _C.TrackerInstall(tracker)
    try:
        costs = _optimizer_costs(optimizer, tracker, optimizer_state, with_8bit)
    finally:
        install.close()
    return profile, costs
