"""memfit inside Hugging Face's Trainer: the Trainer, its arguments, the model, the dataset and
the collator as you have them; name a budget, and train as before. Run it from the repository
root with transformers and accelerate installed:

    python python/examples/hf_trainer.py
"""
import tempfile

import torch
import memfit  # first: from here on its allocator counts every CPU tensor
from memfit.integrations.transformers import fit
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Chunks(torch.utils.data.Dataset):  # your dataset: chunks of 128 tokens for a causal LM
    def __init__(self, samples=512, seq=128, vocab=512):
        self.ids = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def collate(samples):  # your collator
    ids = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


if __name__ == "__main__":
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=128))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             max_steps=5, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=Chunks(), data_collator=collate)
    fitted = fit(trainer, budget="100MB")  # the plain step of 8 x 2 samples peaks at 219 MB
    trainer.train()                        # as before; the plan and each step's peak are in its log
    print(fitted.plan)
    print(f"highest step peak {max(fitted.peaks)} of {fitted.budget_bytes} bytes, "
          f"out-of-memory recoveries {fitted.step.oom_splits}")
