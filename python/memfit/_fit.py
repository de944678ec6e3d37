"""memfit.fit: plan, apply, and verify one real step under the budget."""
from memfit._apply import apply
from memfit._budget import budget as budget_context
from memfit._plan import plan
from memfit._progress import note, observer as make_observer
from memfit._sizes import format_bytes, parse_budget


def fit(model, optimizer, loss_fn, batch, budget, blocks=None, precisions=("fp32", "bf16"), optimizer_state="auto",
        offload="none", host_budget=None, progress=None):
    """Plans the step for ``budget``, applies the plan and runs one real step under it.

    The configuration that fits the first time, at the full batch: a drop-in for halving the
    batch until it fits. ``batch`` is trained on once, as the verifying step (its loss is
    ``step.first_loss``, what it measured ``step.verified``: the peak memfit.budget counted
    against the plan's prediction, which is the peak of a step with the optimizer's state alive;
    ``optimizer_state_made`` says that this step made it, and so may have peaked lower). Every
    later ``step(batch)`` runs under the budget too; an out-of-memory error there splits that
    micro-batch in two and redoes it, as memfit's C++ trainer does, so no sample is lost. Arguments as :func:`memfit.plan`; returns the step
    (:class:`memfit.Step`).
    """
    budget_bytes = parse_budget(budget, "budget")
    obs = make_observer(progress)
    chosen = plan(model, optimizer, loss_fn, batch, budget_bytes, blocks=blocks, precisions=precisions,
                  optimizer_state=optimizer_state, offload=offload, host_budget=host_budget, progress=obs)
    step = apply(model, optimizer, chosen, budget=budget_bytes, progress=obs)
    fresh = not any(step.optimizer.state.values())  # its state is made in this step: a lower peak than later steps'
    with budget_context(budget_bytes, chosen.device) as b:
        step.first_loss = step._step_recovering(batch, budget_bytes)
    measured, predicted = b.peak_bytes, chosen.predicted_peak_bytes
    step.verified = {"peak_bytes": measured, "predicted_peak_bytes": predicted, "budget_bytes": budget_bytes,
                     "oom_splits": step.oom_splits, "optimizer_state_made": fresh}
    made = "; the optimizer's state was made in it, later steps may peak higher" if fresh else ""
    note(obs, f"verified one step under {format_bytes(budget_bytes)}: peak {format_bytes(measured)}, predicted "
              f"{format_bytes(predicted)} ({(measured - predicted) / max(predicted, 1):+.1%}){made}")
    obs.close()
    return step
