"""Hugging Face models as users train them, tiny: a causal LM (GPT-2) on fixed-length token
chunks, and a sequence classifier (BERT) on sentences of different lengths padded per batch by
its collator; a Trainer for each that records its training_step's losses. Built from config
classes: nothing is downloaded."""
import tempfile

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

import memfit

transformers.logging.set_verbosity_error()


class TokenChunks(torch.utils.data.Dataset):
    """Causal LM samples: chunks of `seq` tokens, labels the inputs (the model shifts them)."""

    def __init__(self, samples=256, seq=64, vocab=256, seed=1):
        self.ids = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def collate_chunks(samples):
    ids = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.stack([s["labels"] for s in samples])}


class Sentences(torch.utils.data.Dataset):
    """Classification samples of 8 to `longest` tokens, one of three labels."""

    def __init__(self, samples=256, longest=48, vocab=256, seed=2):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(8, longest + 1, (samples,), generator=g)
        self.samples = [(torch.randint(1, vocab, (int(n),), generator=g), int(torch.randint(0, 3, (), generator=g)))
                        for n in lengths]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        ids, label = self.samples[i]
        return {"input_ids": ids, "label": label}


def collate_padded(samples):
    """Pads to the batch's longest sentence (token 0), as DataCollatorWithPadding does."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s["input_ids"])] = s["input_ids"]
        mask[i, :len(s["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["label"] for s in samples])}


def causal_lm(layers=2, d=64, heads=4, vocab=256, seq=64, dropout=0.1):
    """GPT-2's dropout (0.1) by default: a Trainer given the plan's micro-batch by hand draws the
    same masks. A step split after an out-of-memory error draws them per part instead."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=seq,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


def causal_lm_without_dropout():
    return causal_lm(dropout=0.0)


def sequence_classifier(layers=2, d=64, heads=4, vocab=256, seq=64, dropout=0.0):
    """Dropout off by default: its draws follow the padded shape, which differs between the
    whole batch (padded to its longest sentence) and each micro-batch a Trainer loads by hand."""
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers,
                                                    num_attention_heads=heads, intermediate_size=4 * d,
                                                    max_position_embeddings=seq, num_labels=3,
                                                    hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))


class RecordingTrainer(transformers.Trainer):
    """A Trainer whose training_step's losses are kept by step: what it returns is that call's
    part of the step's loss, so a step's loss is their sum."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded = {}

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        step = self.state.global_step
        self.recorded[step] = self.recorded.get(step, 0.0) + float(loss)
        return loss

    def step_losses(self):
        return [self.recorded[s] for s in sorted(self.recorded)]


def trainer(model, dataset, collate, batch, steps, accumulation=1, bf16=False, optimizer=None, callbacks=(),
            trainer_class=RecordingTrainer, **arguments):
    """A Trainer on the CPU, logging every step, saving nothing; AdamW unless `optimizer` is
    given (a function of the model's parameters)."""
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="memfit-trainer-"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=1e-3, logging_steps=1, seed=0,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=bf16, **arguments)
    optimizers = (optimizer(model.parameters()), None) if optimizer is not None else (None, None)
    return trainer_class(model=model, args=args, train_dataset=dataset, data_collator=collate, optimizers=optimizers,
                         callbacks=list(callbacks))


class StepPeaks(transformers.TrainerCallback):
    """Each step's peak as memfit's allocator counts it, with no budget."""

    def __init__(self):
        self.peaks = []
        self._budget = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._budget = memfit.budget(1 << 40)
        self._budget.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self._budget.__exit__(None, None, None)
        self.peaks.append(self._budget.peak_bytes)


def plain_peak(make_model, dataset, collate, batch, accumulation=1, steps=2):
    """The plain Trainer's step peak (the highest of `steps`: the first makes the optimizer's state)."""
    peaks = StepPeaks()
    trainer(make_model(), dataset, collate, batch, steps, accumulation=accumulation, callbacks=[peaks]).train()
    return max(peaks.peaks)


def by_hand(make_model, dataset, collate, plan, steps, accumulation=1):
    """The same Trainer given the plan's micro-batch, accumulation, precision and optimizer state by hand."""
    optimizer = (lambda ps: memfit.Adam8bit(ps, lr=1e-3, weight_decay=0.0)) if plan.optimizer_state == "8bit" else None
    return trainer(make_model(), dataset, collate, plan.micro_batch, steps, accumulation=plan.accumulation * accumulation,
                   bf16=plan.precision == "bf16", optimizer=optimizer)
