"""The costs of the user's step, measured, in the C++ planner's terms (plan/profile.h): each
part of the chain at a quarter and a half of the batch for each precision, the plain chain's
seconds by micro-batch, and the optimizer's state and step."""
import time

import torch

from memfit import _batch, _storage
from memfit._loader import load
from memfit._measure import ChainRunner, autocast, scalar_loss
from memfit._progress import note

_C = load()

# A mixed precision running this many times slower than fp32 is not profiled (as in profile.h).
SLOW_PRECISION_RATIO = 3.0
# The sizes every part is profiled at, as the C++ profile takes them (plan/timing_rounds.h).
profiled_sizes = _C.profiled_sizes


class ChainTimer:
    """Seconds of the plain step's forward + backward on the first m samples, as a step runs
    them: adding into gradients already there unless m is the whole batch (profile.h)."""

    def __init__(self, model, loss_fn, batch, device):
        self.model, self.loss_fn, self.batch, self.device = model, loss_fn, batch, device
        self.samples = _batch.sample_count(batch)
        self.parameters = [p for p in model.parameters() if p.requires_grad]

    def run(self, precision, m):
        if m >= self.samples:
            self.release_gradients()
        else:
            self.ensure_gradients()
        part = _batch.narrow(self.batch, 0, m)
        t0 = time.perf_counter()
        with autocast(self.device, precision):
            loss = scalar_loss(self.loss_fn(self.model, part))
        loss.backward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def ensure_gradients(self):
        for p in self.parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def release_gradients(self):
        for p in self.parameters:
            p.grad = None

    def medians(self, sizes, first_use):
        """Each (precision, m)'s median seconds by the C++ profile's rule (plan/timing_rounds.h):
        first uses where the sizes may be new, then alternating rounds."""
        rounds = _C.TimingRounds(len(sizes))
        for i, (precision, m) in enumerate(sizes if first_use else []):
            rounds.first_use(i, self.run(precision, m))
        for round_ in iter(rounds.next_round, []):
            for i in round_:
                rounds.add(i, self.run(*sizes[i]))
        self.release_gradients()
        return rounds.medians()

    def __call__(self, precision, sizes, ref_precision, ref_m, ref_seconds):
        """The planner's ChainTimer (job.h): sizes timed beside a reference point, on its scale."""
        all_sizes = [(precision, m) for m in sizes] + [(ref_precision, ref_m)]
        return _C.on_reference_scale(self.medians(all_sizes, first_use=True), ref_seconds)


def _moments(tracker, events, offset, peak):
    """A part's peak moments (plan/peak_moments.h) in bytes above `offset`, as its peak is
    (`peak`, unclamped); unusable where the part was not recorded or the events miss the peak."""
    if events is None:
        return _C.PeakMoments()
    first, last, live0 = events
    return tracker.peak_moments(first, last, live0, offset, peak)


def _block_moments(tracker, parts, offsets):
    """Each part's moments in its forward and backward (the run's events still recorded), in
    bytes above `offsets[i]` (forward, backward): the terms its peaks are put in."""
    out = []
    for i in range(parts.count):
        fwd, bwd = offsets[i]
        m = _C.BlockMoments()
        m.forward = _moments(tracker, parts.fwd_events[i], fwd, parts.fwd_peak[i] - fwd)
        m.backward = _moments(tracker, parts.bwd_events[i], bwd, parts.bwd_peak[i] - bwd)
        out.append(m)
    return out


def _add_accumulating(tracker, costs, moments, offsets, plain, accumulating):
    """Each part's backward with every gradient there before, added into (a step's later
    micro-batches): its peak above the live bytes at its start, in the terms of the plain run's
    backward offsets less the gradients of later parts (alive from the start of this run); and
    what is live beyond those terms at its first read of a saved tensor (where a non-reentrant
    checkpoint recomputes the segment it ends)."""
    later_gradients = 0
    for i in reversed(range(len(costs))):
        offset = offsets[i][1] - plain.run_live0 - later_gradients + accumulating.run_live0
        peak = accumulating.bwd_peak[i] - offset
        costs[i].backward_peak_accumulating = max(0, peak)
        moments[i].backward_accumulating = _moments(tracker, accumulating.bwd_events[i], offset, peak)
        read = accumulating.first_read_live[i]
        if read is not None:  # (the offset counts the gradient arriving for its output)
            costs[i].recompute_start_extra_bytes = max(0, read - offset)
        later_gradients += costs[i].param_bytes


def _add_streamed(costs, offsets, plain, streamed):
    """Each part's backward with each gradient leaving once made (the optimizer offloaded): its
    peak above the plain run's backward offsets less the gradients of later parts (gone)."""
    later_gradients = 0
    for i in reversed(range(len(costs))):
        offset = offsets[i][1] - plain.run_live0 - later_gradients + streamed.run_live0
        costs[i].backward_peak_streamed = max(0, streamed.bwd_peak[i] - offset)
        later_gradients += costs[i].param_bytes


def _add_nograd(tracker, costs, moments, nograd):
    """The forward without grad's peaks, each above its part's start (its input alive: the
    schedule counts the input, and what earlier parts left, beside it), and their moments."""
    for i, (c, m) in enumerate(zip(costs, moments)):
        start = nograd.fwd_events[i][2]
        peak = nograd.fwd_peak[i] - start
        c.forward_nograd_peak = max(0, peak)
        m.forward_nograd = _moments(tracker, nograd.fwd_events[i], start, peak)


def _block_costs(parts, kept, output_kept, parameters):
    """The parts' costs in the planner's model (plan/schedule.h): its peaks are above the bytes
    the model counts at that moment (fixed bytes, what earlier parts keep, the gradients of later
    parts, the incoming gradient), so the peaks measured here, absolute, are turned into those
    terms: the model then reproduces the plain run it was measured on. With the costs, each
    part's offsets (forward, backward): the live bytes its peaks are measured above."""
    count = parts.count
    param = [sum(_storage.storage_bytes(p) for p in parameters if id(p) in parts.grad_ids[i]) for i in range(count)]
    # An output counts as kept when this part made it and it is alive at the end of forward (a
    # view of the batch, or of an earlier part's tensor, is not this part's to keep).
    kept_output = [i == count - 1 or (output_kept[i] and kept[i] >= parts.out_bytes[i]) for i in range(count)]
    internal = [max(0, kept[i] - (parts.out_bytes[i] if kept_output[i] else 0)) for i in range(count)]
    bases, held = [], 0  # each part's start as the model counts it: what the parts before keep
    for i in range(count):
        bases.append(parts.run_live0 + held)
        held += internal[i] + (parts.out_bytes[i] if kept_output[i] else 0)
    left = _left_before(parts, kept_output, bases)
    costs, offsets = [], []
    for i in range(count):
        c = _C.BlockCost()
        c.forward_seconds = parts.fwd_seconds[i]
        c.backward_seconds = parts.bwd_seconds[i]
        c.output_bytes = parts.out_bytes[i]
        c.output_kept = kept_output[i]
        c.kept_bytes = kept[i]
        c.forward_left_bytes = left[i + 1] - left[i] if i + 1 < count else 0
        later_gradients = sum(param[i + 1:])
        offsets.append((bases[i] + left[i], bases[i] + later_gradients + c.output_bytes + internal[i]))
        c.forward_peak = max(0, parts.fwd_peak[i] - offsets[-1][0])
        c.backward_peak = max(0, parts.bwd_peak[i] - offsets[-1][1])
        c.param_bytes = param[i]
        c.cast_bytes = 0  # measured inside the parts' own bytes (casts made as the step makes them)
        c.recomputable = 0 < i < count - 1
        # In the schedule model's terms (schedule.h): the gradient arriving for the output is
        # alive under the part's backward (and held to a segment's end); the peak above it is
        # measured here with the gradients absent (a step's first micro-batch), and with them
        # there in _add_accumulating.
        c.keeps_own_output = True
        c.backward_held_by_segment_bytes = c.output_bytes
        c.backward_held_all_bytes = c.output_bytes
        costs.append(c)
    return costs, offsets


def _left_before(parts, kept_output, bases):
    """What is live at each part's start beyond what the model counts there (the bytes the
    parts before keep, the input where it is not kept): what their forward left until forward
    ends (a Python model's locals such as the embeddings' sum, key/value caches returned with
    its output). Gone by backward, so a part's forward peak is taken above them."""
    left = []
    for i in range(parts.count):
        unkept_input = parts.out_bytes[i - 1] if i > 0 and not kept_output[i - 1] else 0
        left.append(max(0, parts.fwd_events[i][2] - bases[i] - unkept_input))
    return left


class Profiler:
    """Measures the user's step (the tracker installed on this thread by the caller)."""

    def __init__(self, model, loss_fn, batch, blocks, device, tracker, observer, streamed=False):
        self.model, self.batch, self.device = model, batch, device
        self.streamed = streamed  # the optimizer may be offloaded: the streamed backward is measured too
        self.tracker, self.observer = tracker, observer
        self.samples = _batch.sample_count(batch)
        self.runner = ChainRunner(model, loss_fn, blocks, device)
        self.timer = ChainTimer(model, loss_fn, batch, device)
        self.count = len(blocks) + 2
        self.done, self.total = 0, 1

    def _progress(self, what):
        self.done += 1
        self.observer.on_progress(min(self.done, self.total), self.total, what)

    def chain_profile(self, precision, m):
        part = _batch.narrow(self.batch, 0, m)
        parts, kept, output_kept = self.runner.measure(self.tracker, part, precision)
        costs, offsets = _block_costs(parts, kept, output_kept, self.runner.parameters)
        moments = _block_moments(self.tracker, parts, offsets)  # before the next run's recording
        accumulating = self.runner.measure(self.tracker, part, precision, accumulating=True)[0]
        _add_accumulating(self.tracker, costs, moments, offsets, parts, accumulating)
        nograd = self.runner.measure_nograd(self.tracker, part, precision)
        _add_nograd(self.tracker, costs, moments, nograd)
        if self.streamed:
            _add_streamed(costs, offsets, parts, self.runner.measure(self.tracker, part, precision, streamed=True)[0])
        cp = _C.ChainProfile()
        cp.micro_batch = m
        cp.blocks, cp.moments = costs, moments
        cp.forward_nograd_seconds = sum(nograd.fwd_seconds[1:-1])
        return cp

    def one_sample(self, precision):
        """The blocks at one sample (their bytes fit the sizes below the quarter: some ops keep
        more at one sample than the line through larger sizes says), or none (micro_batch 0)
        where the model cannot train on one sample, as BatchNorm on a 1x1 map."""
        try:
            return self.chain_profile(precision, 1)
        except (RuntimeError, ValueError):
            return _C.ChainProfile()

    def precision_profile(self, precision):
        a, b = profiled_sizes(self.samples)
        pp = _C.PrecisionProfile(precision)
        self.chain_profile(precision, b)  # first use of the size (and warm-up)
        pp.large = self.chain_profile(precision, b)
        self._progress(f"{precision}, {b} samples")
        pp.small = self.chain_profile(precision, a) if a < b else pp.large
        self._progress(f"{precision}, {a} samples")
        if a > 1:
            pp.one_sample = self.one_sample(precision)
        pp.calibration = 1.0  # the parts' peaks are put in the model's terms as measured
        return pp

    def slowdown(self, precision, baseline="fp32"):
        """How many times slower `precision` runs a two-sample step than the baseline (best of
        three, alternating, after a first use of each). Two: BatchNorm cannot train on one
        sample where a layer's output is 1x1."""
        m = min(2, self.samples)
        self.timer.run(baseline, m)
        self.timer.run(precision, m)
        base = slow = float("inf")
        for _ in range(3):
            base = min(base, self.timer.run(baseline, m))
            slow = min(slow, self.timer.run(precision, m))
        self.timer.release_gradients()
        return slow / base if base > 0 else 1.0

    def profile(self, precisions):
        """The WorkloadProfile: precisions dropped (too slow, or failing on this model) noted."""
        self.total = 2 * len(precisions) + 1
        profile = _C.WorkloadProfile()
        profile.batch = self.samples
        profile.weight_bytes = _storage.unique_bytes(self.model.parameters())
        profile.batch_bytes = _batch.storage_bytes(self.batch)
        profile.segment_overhead_bytes = _C.capture_rng(str(self.device)).cpu_bytes
        profile.non_reentrant_checkpoint = True  # as _checkpoint.py recomputes
        profiles, notes = [], []
        for precision in precisions:
            if precision != precisions[0]:
                dropped = self._dropped(precision, precisions[0])
                if dropped:
                    notes.append(dropped)
                    self.done += 2
                    continue
            profiles.append(self.precision_profile(precision))
        fastest = min(profiles, key=lambda pp: sum(c.forward_seconds + c.backward_seconds for c in pp.large.blocks))
        a, b = fastest.small.micro_batch, fastest.large.micro_batch
        sizes = [(fastest.precision, a)] + ([(fastest.precision, b)] if b != a else [])
        seconds = self.timer.medians(sizes, first_use=False)  # a and b ran before (profiled)
        fastest.chain_seconds = [(m, s) for (_, m), s in zip(sizes, seconds)]
        self._progress("timed")
        profile.precisions = profiles
        profile.notes = notes
        for text in notes:
            note(self.observer, text)
        return profile

    def _dropped(self, precision, baseline):
        """Why a mixed precision is not profiled, or None when it is."""
        try:
            ratio = self.slowdown(precision, baseline)
        except (RuntimeError, TypeError) as e:
            self.timer.release_gradients()
            if "out of memory" in str(e):
                raise
            return f"{precision} not considered: it fails on this model ({str(e).splitlines()[0][:160]})"
        if ratio > SLOW_PRECISION_RATIO:
            return (f"{precision} not considered: one sample's step ran {ratio:.1f}x slower than {baseline} here "
                    f"(over {SLOW_PRECISION_RATIO:.0f}x: too slow to be the fastest); "
                    f"precisions=('{precision}',) plans with it alone")
        return None


# --- the optimizer -------------------------------------------------------------------------

_FAMILIES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "RMSprop": "rmsprop", "Adagrad": "adagrad"}


def optimizer_family(optimizer):
    """The C++ family name of a torch.optim optimizer (others plan as AdamW-like fp32 state)."""
    return _FAMILIES.get(type(optimizer).__name__, "adamw")


def has_8bit_state(optimizer):
    """Whether memfit's 8-bit state can stand in for this optimizer's (plain Adam or AdamW)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(not g.get("amsgrad", False) and not g.get("maximize", False) for g in optimizer.param_groups)


def _copy_optimizer(optimizer, groups):
    cls = type(optimizer)
    try:
        return cls(groups, **optimizer.defaults)
    except TypeError:
        return cls(groups)


def measure_optimizer(optimizer, tracker, with_8bit):
    """The optimizer's costs on copies of its parameters (zero gradients): state bytes (alive
    between steps), the step's temporaries above them, and a steady step's seconds; with_8bit:
    memfit's 8-bit state's too (its maps, made by plan() beforehand, are resident bytes)."""
    groups, clones = [], []
    with torch.no_grad():
        for g in optimizer.param_groups:
            params = [p.detach().clone().requires_grad_(p.requires_grad) for p in g["params"]]
            for p in params:
                p.grad = torch.zeros_like(p)
            clones += params
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    copy = _copy_optimizer(optimizer, groups)
    costs = [_C.measure_optimizer_steps(copy.step, "fp32", tracker)]  # the C++ rule, this optimizer's steps
    if with_8bit:
        g = optimizer.param_groups[0]
        del copy
        costs.append(_C.measure_8bit_cost(tracker, clones, g["lr"], g["betas"][0], g["betas"][1], g["weight_decay"],
                                          type(optimizer) is torch.optim.AdamW))
    return costs
