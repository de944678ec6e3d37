"""memfit.integrations.lightning.MemfitCallback on a LightningModule: each step under the budget,
the training that of the same Trainer given the plan's batch and accumulation by hand, what
training_step logs logged once per batch, and settings it cannot plan refused."""

import pytest
import torch

if torch.__version__ < "2":
    pytest.skip("Debian's torch 1.13 cannot import torch.distributed._shard under Python 3.11, which every "
                "LightningModule's constructor does (lightning 2.x)", allow_module_level=True)
L = pytest.importorskip("lightning.pytorch")

import memfit  # noqa: E402
from lightning_models import CausalLM, by_hand, loader, plain_peak, trainer  # noqa: E402
from memfit.integrations.lightning import MemfitCallback  # noqa: E402
from trainer_models import causal_lm, causal_lm_without_dropout  # noqa: E402

STEPS = 4


class Logged(L.Callback):
    def __init__(self):
        self.metrics = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_a_lightning_module_trains_under_45_percent_of_the_plain_step_as_by_hand():
    budget = int(plain_peak(CausalLM, loader(16)) * 0.45)
    callback, logged = MemfitCallback(budget, progress=False), Logged()
    module = CausalLM()
    trainer(STEPS, [callback, logged]).fit(module, loader(16))
    plan = callback.plan
    assert plan.micro_batch < 16 and plan.micro_batch * plan.accumulation == 16
    assert len(callback.peaks) == STEPS and max(callback.peaks) <= budget, (callback.peaks, budget)
    assert callback.step.oom_splits == 0
    assert [m["memfit/peak_bytes"] for m in logged.metrics] == callback.peaks
    mine = module.step_losses()
    # self.log("train_loss") ran once per micro-batch: logged once per step, as the step's loss
    assert [m["train_loss"] for m in logged.metrics] == pytest.approx(mine, rel=1e-6)
    reference = by_hand(causal_lm, plan, STEPS, loader(plan.micro_batch))
    torch.testing.assert_close(torch.tensor(mine), torch.tensor(reference.step_losses(plan.accumulation)), rtol=1e-4,
                               atol=1e-6)
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert not memfit._calls.intercepted(module), "memfit is taken off the module when training ends"


class FailingOnce(CausalLM):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and not getattr(self, "failed", False):
            self.failed = True
            memfit._C.fail_allocation_after(50)
        return super().training_step(batch, batch_idx)


def test_an_out_of_memory_error_is_recovered_and_loses_no_sample():
    # Without dropout: where the plan recomputes every layer already, the recovery splits the
    # step, whose parts draw other masks than the whole batch does by hand.
    callback = MemfitCallback("1GiB", precisions=("fp32",), optimizer_state="fp32", progress=False)
    module = FailingOnce(make_model=causal_lm_without_dropout)
    try:
        trainer(STEPS, [callback]).fit(module, loader(16))
    finally:
        memfit._C.fail_allocation_after(0)
    assert module.failed and callback.step.oom_splits == 1
    reference = by_hand(causal_lm_without_dropout, callback.plan, STEPS, loader(callback.plan.micro_batch))
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_an_offloaded_optimizer_steps_on_the_host_and_lightning_clips_it_there():
    callback = MemfitCallback("1GiB", precisions=("fp32",), optimizer_state="fp32", offload="optimizer", progress=False)
    module = CausalLM()
    trainer(STEPS, [callback], gradient_clip_val=0.1).fit(module, loader(16))
    assert callback.plan.optimizer_offloaded and max(callback.peaks) <= callback.budget_bytes
    assert all(p.grad is None for p in module.parameters()), "no gradient is left on the device"
    plan = callback.plan
    reference = CausalLM()
    trainer(STEPS, accumulate=plan.accumulation, gradient_clip_val=0.1).fit(reference, loader(plan.micro_batch))
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


class Broken(CausalLM):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise KeyError("no such column")
        return super().training_step(batch, batch_idx)


def test_any_other_error_reaches_the_user_as_it_was_and_leaves_no_budget():
    callback, module = MemfitCallback("1GiB", precisions=("fp32",), progress=False), Broken()
    before = memfit._C.budget_bytes()
    with pytest.raises(KeyError, match="no such column"):
        trainer(STEPS, [callback]).fit(module, loader(16))
    assert memfit._C.budget_bytes() == before and callback.step.oom_splits == 0
    assert not memfit._calls.intercepted(module) and "training_step" not in module.__dict__


@pytest.mark.parametrize("arguments,message", [
    ({"accumulate_grad_batches": 2}, "accumulate_grad_batches 2: memfit accumulates"),
    ({"precision": "64-true"}, "precision '64-true': expected one of '32-true', '32', 'bf16-mixed'"),
])
def test_settings_it_cannot_plan_are_named(arguments, message):
    callback = MemfitCallback("1GiB", progress=False)
    with pytest.raises(ValueError, match=message):
        L.Trainer(max_steps=1, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  **arguments).fit(CausalLM(), loader(8))


def test_a_compiled_module_is_refused_by_name():
    callback = MemfitCallback("1GiB", progress=False)
    with pytest.raises(ValueError, match=r"the LightningModule: compiled by model.forward = torch.compile"):
        trainer(1, [callback]).fit(torch.compile(CausalLM()), loader(8))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="budget 'lots'"):
        MemfitCallback("lots")
