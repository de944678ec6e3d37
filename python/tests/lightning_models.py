"""A Hugging Face GPT-2 trained by a LightningModule, as users wrap one, and the Trainer the
tests and the benchmark run it with: one CPU device, nothing saved or logged to disk."""
import collections

import lightning.pytorch as L
import torch

import memfit
from trainer_models import TokenChunks, causal_lm


class CausalLM(L.LightningModule):
    """Each training_step call's batch index, samples and loss are kept (``calls``)."""

    def __init__(self, make_model=causal_lm, optimizer=torch.optim.AdamW, steps=4):
        super().__init__()
        self.model = make_model()
        self.optimizer, self.steps = optimizer, steps
        self.calls = []

    def on_train_start(self):
        self.calls.clear()  # after memfit's callback planned: its profile runs training_step too

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.calls.append((batch_idx, len(batch["input_ids"]), loss.item()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, self.steps)
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    def step_losses(self, batches_per_step=1):
        """Each step's loss: its batches' losses weighted by their samples."""
        steps = collections.defaultdict(list)
        for batch_idx, samples, loss in self.calls:
            steps[batch_idx // batches_per_step].append((samples, loss))
        return [sum(n * v for n, v in s) / sum(n for n, _ in s) for _, s in sorted(steps.items())]


def loader(batch, dataset=None):
    """The samples shuffled by the loader's own generator, in batches of `batch`."""
    dataset = dataset if dataset is not None else TokenChunks()
    samples = [dataset[i] for i in range(len(dataset))]
    return torch.utils.data.DataLoader(samples, batch_size=batch, shuffle=True,
                                       generator=torch.Generator().manual_seed(2))


class StepPeaks(L.Callback):
    """Each step's peak as memfit's allocator counts it, with no budget."""

    def __init__(self):
        self.peaks = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.budget = memfit.budget(1 << 40)
        self.budget.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.budget.__exit__(None, None, None)
        self.peaks.append(self.budget.peak_bytes)


def trainer(steps, callbacks=(), accumulate=1, **arguments):
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=list(callbacks), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     accumulate_grad_batches=accumulate, num_sanity_val_steps=0, **arguments)


def plain_peak(make_module, batch_loader):
    peaks = StepPeaks()
    trainer(2, [peaks]).fit(make_module(), batch_loader)
    return max(peaks.peaks)


def by_hand(make_model, plan, steps, batch_loader):
    """The same Trainer given the plan's micro-batch, accumulation, precision and optimizer state by hand."""
    optimizer = (lambda ps, lr: memfit.Adam8bit(ps, lr=lr)) if plan.optimizer_state == "8bit" else torch.optim.AdamW
    reference = CausalLM(make_model, optimizer, steps)
    trainer(steps, accumulate=plan.accumulation,
            precision="bf16-mixed" if plan.precision == "bf16" else "32-true").fit(reference, batch_loader)
    return reference
