"""memfit.integrations.transformers.fit on Hugging Face's Trainer: each step under the budget,
the training that of the same Trainer given the plan's batch and accumulation by hand, an
out-of-memory error recovered with no sample lost, and settings it cannot plan refused."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import memfit  # noqa: E402
from memfit.integrations import transformers as hf  # noqa: E402
from trainer_models import (RecordingTrainer, Sentences, TokenChunks, by_hand, causal_lm,  # noqa: E402
                            causal_lm_without_dropout, collate_chunks, collate_padded, plain_peak,
                            sequence_classifier, trainer)

STEPS = 4
# Hugging Face's checkpointing of every layer (transformers 5 renamed the argument)
EVERY_LAYER = ("activation_checkpointing" if hasattr(transformers.TrainingArguments, "activation_checkpointing")
               else "gradient_checkpointing")


@pytest.fixture(autouse=True)
def plans_removed():
    """A fitted Trainer stays registered with memfit (memfit.remove(model) lets it go): no test
    leaves one, or its bytes, to the next."""
    yield
    for model in list(memfit._apply._applied):
        memfit.remove(model)


def assert_same_training(fitted_trainer, reference, rtol=1e-4):
    mine, theirs = fitted_trainer.step_losses(), reference.step_losses()
    assert len(mine) == len(theirs) == STEPS
    torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), rtol=rtol, atol=1e-6)
    for p, q in zip(fitted_trainer.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-5)


def test_a_causal_lm_trains_under_45_percent_of_the_plain_step_as_by_hand():
    dataset = TokenChunks()
    budget = int(plain_peak(causal_lm, dataset, collate_chunks, 16) * 0.45)
    t = trainer(causal_lm(), dataset, collate_chunks, 16, STEPS)
    fitted = hf.fit(t, budget, progress=False)
    t.train()
    plan = fitted.plan
    assert plan.micro_batch < 16 and plan.micro_batch * plan.accumulation == 16
    assert len(fitted.peaks) == STEPS and max(fitted.peaks) <= budget, (fitted.peaks, budget)
    assert fitted.step.oom_splits == 0
    logged = t.state.log_history
    assert logged[0]["memfit/micro_batch"] == plan.micro_batch and logged[0]["memfit/budget_bytes"] == budget
    assert [e["memfit/peak_bytes"] for e in logged if "loss" in e] == fitted.peaks
    reference = by_hand(causal_lm, dataset, collate_chunks, plan, STEPS)
    reference.train()
    assert_same_training(t, reference)


def test_a_sequence_classifier_with_its_own_accumulation_keeps_its_effective_batch():
    """Per-device 8 x accumulation 2: memfit loads the 16 samples whole and runs the plan's
    micro-batches; the padding collator pads each batch to its longest sentence. Hugging Face's
    checkpointing of every layer, asked for, gives way to the plan's."""
    dataset = Sentences()
    budget = int(plain_peak(sequence_classifier, dataset, collate_padded, 16) * 0.5)
    t = trainer(sequence_classifier(), dataset, collate_padded, 8, STEPS, accumulation=2, **{EVERY_LAYER: True})
    fitted = hf.fit(t, budget, precisions=("fp32",), optimizer_state="fp32", progress=False)
    assert (t.args.per_device_train_batch_size, t.args.gradient_accumulation_steps) == (16, 1)
    t.train()
    assert not hf._recomputes_layers(t.model)
    assert max(fitted.peaks) <= budget and fitted.step.oom_splits == 0
    reference = by_hand(sequence_classifier, dataset, collate_padded, fitted.plan, STEPS)
    reference.train()
    assert_same_training(t, reference)


class FailingOnce(RecordingTrainer):
    """Its third step's forward meets an out-of-memory error (its 50th allocation fails, once)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.state.global_step == 2 and not getattr(self, "failed", False):
            self.failed = True
            memfit._C.fail_allocation_after(50)
        return super().compute_loss(model, inputs, *args, **kwargs)


def test_an_out_of_memory_error_is_recovered_and_loses_no_sample():
    # Without dropout: where the plan recomputes every layer already, the recovery splits the
    # step, whose parts draw other masks than the whole batch does in the Trainer by hand.
    dataset = TokenChunks()
    t = trainer(causal_lm_without_dropout(), dataset, collate_chunks, 16, STEPS, trainer_class=FailingOnce)
    fitted = hf.fit(t, "1GiB", precisions=("fp32",), optimizer_state="fp32", progress=False)
    try:
        t.train()
    finally:
        memfit._C.fail_allocation_after(0)
    assert t.failed and fitted.step.oom_splits == 1
    reference = by_hand(causal_lm_without_dropout, dataset, collate_chunks, fitted.plan, STEPS)
    reference.train()
    assert_same_training(t, reference)


class Broken(RecordingTrainer):
    """compute_loss raises once `broken` is set (after planning)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        if getattr(self, "broken", False):
            raise KeyError("no such column")
        return super().compute_loss(model, inputs, *args, **kwargs)


def test_any_other_error_reaches_the_user_as_it_was_and_leaves_no_budget():
    t = trainer(causal_lm(), TokenChunks(), collate_chunks, 8, STEPS, trainer_class=Broken)
    fitted = hf.fit(t, "1GiB", precisions=("fp32",), progress=False)
    t.broken = True
    before = memfit._C.budget_bytes()
    with pytest.raises(KeyError, match="no such column"):
        t.train()
    assert memfit._C.budget_bytes() == before and fitted.step.oom_splits == 0


def test_remove_gives_the_trainer_its_own_step_back():
    t = trainer(causal_lm(), TokenChunks(), collate_chunks, 8, STEPS)
    fitted = hf.fit(t, "1GiB", precisions=("fp32",), progress=False)
    assert memfit._calls.intercepted(t.model)
    fitted.remove()
    assert not memfit._calls.intercepted(t.model) and "training_step" not in t.__dict__
    assert not memfit.remove(t.model)


@pytest.mark.parametrize("arguments,message", [
    ({"auto_find_batch_size": True}, "auto_find_batch_size=True: memfit plans the batch instead; expected False"),
    ({"torch_compile": True}, "torch_compile=True"),
])
def test_settings_it_cannot_plan_are_named(arguments, message):
    t = trainer(causal_lm(), TokenChunks(), collate_chunks, 8, STEPS)
    for name, value in arguments.items():  # set after: a Trainer made with torch_compile sets accelerate's shared state
        setattr(t.args, name, value)
    with pytest.raises(ValueError, match=message):
        hf.fit(t, "1GiB", progress=False)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="trainer str: expected a transformers.Trainer"):
        hf.fit("trainer", "1GiB")
    t = trainer(causal_lm(), TokenChunks(), collate_chunks, 8, STEPS, bf16=True)
    with pytest.raises(ValueError, match=r"precisions \('fp32',\): the Trainer runs bf16"):
        hf.fit(t, "1GiB", precisions=("fp32",), progress=False)
    with pytest.raises(ValueError, match="budget 'lots'"):
        hf.fit(t, "lots")
    getattr(t.model, "activation_checkpointing_enable", t.model.gradient_checkpointing_enable)()
    with pytest.raises(ValueError, match="gradient checkpointing is on"):
        hf.fit(t, "1GiB", progress=False)


def test_an_offloaded_optimizer_steps_on_the_host_and_clips_there_as_the_trainer_would():
    """max_grad_norm stays 1.0: the Trainer's clipping moves to the host masters' gradients."""
    dataset = TokenChunks()
    t = trainer(causal_lm(), dataset, collate_chunks, 16, STEPS)
    fitted = hf.fit(t, "1GiB", precisions=("fp32",), optimizer_state="fp32", offload="optimizer", progress=False)
    assert fitted.plan.optimizer_offloaded and t.args.max_grad_norm == 0
    t.train()
    assert max(fitted.peaks) <= fitted.budget_bytes
    assert all(p.grad is None for p in t.model.parameters()), "no gradient is left on the device"
    reference = by_hand(causal_lm, dataset, collate_chunks, fitted.plan, STEPS)
    reference.train()
    assert_same_training(t, reference)
    norms = [[e["grad_norm"] for e in run.state.log_history if "loss" in e] for run in (t, reference)]
    torch.testing.assert_close(torch.tensor(norms[0]), torch.tensor(norms[1]), rtol=1e-4, atol=0)


def test_a_bf16_plan_trains_as_the_trainer_set_to_bf16_by_hand():
    """memfit's autocast around compute_loss, where the Trainer's arguments say fp32."""
    dataset = TokenChunks()
    t = trainer(causal_lm(), dataset, collate_chunks, 16, STEPS)
    fitted = hf.fit(t, "1GiB", precisions=("bf16",), optimizer_state="fp32", progress=False)
    assert fitted.plan.precision == "bf16" and not t.args.bf16
    t.train()
    reference = by_hand(causal_lm, dataset, collate_chunks, fitted.plan, STEPS)
    assert reference.args.bf16
    reference.train()
    assert_same_training(t, reference)
