"""memfit inside PyTorch Lightning: your LightningModule and DataLoader as you have them, and a
callback naming the budget. Run it from the repository root with lightning and transformers
installed (torch 2.x):

    python python/examples/lightning_trainer.py
"""
import torch
import memfit  # first: from here on its allocator counts every CPU tensor
import lightning.pytorch as L
from memfit.integrations.lightning import MemfitCallback
from transformers import GPT2Config, GPT2LMHeadModel


class CausalLM(L.LightningModule):  # your LightningModule
    def __init__(self):
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=128))

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)  # logged once per batch: the batch's loss
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader():  # your DataLoader: it gives the whole batch (memfit accumulates)
    ids = torch.randint(0, 512, (512, 128), generator=torch.Generator().manual_seed(0))
    samples = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]
    return torch.utils.data.DataLoader(samples, batch_size=16, shuffle=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    memfit_callback = MemfitCallback(budget="100MB")  # the plain step of 16 samples peaks near 219 MB
    trainer = L.Trainer(max_steps=5, accelerator="cpu", devices=1, callbacks=[memfit_callback], logger=False,
                        enable_checkpointing=False)
    trainer.fit(CausalLM(), loader())
    print(memfit_callback.plan)
    print(f"highest step peak {max(memfit_callback.peaks)} of {memfit_callback.budget_bytes} bytes, "
          f"out-of-memory recoveries {memfit_callback.step.oom_splits}")
