"""memfit.plan + memfit.apply on real models from their own libraries: Hugging Face's GPT-2 and
BERT (transformers 4.40.2, built from small configs, random weights) and torchvision's ResNet-18
and MobileNetV2 (Debian's python3-torchvision). For each, at 60%, 45% and 30% of the plain
step's peak: the plan (offload="auto": the optimizer goes to the host where the device alone
cannot fit, or where that is predicted faster), the peak memfit.budget measured over three
steps, and the prediction's error. Prints one markdown table; exits 1 if a step went over its budget or missed its
prediction by over 3% either way.

    bash bench/python/real_models.sh          # makes .venv-hf (transformers 4.40.2), runs this
"""
import gc
import os
import sys

import torch
import torch.nn.functional as F

import memfit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unnamed_models import applied_peak  # noqa: E402

FRACTIONS = (0.6, 0.45, 0.3)
TOLERANCE = 0.03


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=2048, n_positions=128, n_embd=192, n_layer=4, n_head=4)
    ids = torch.randint(0, config.vocab_size, (16, 128))
    mask = torch.ones_like(ids)
    mask[::4, -16:] = 0  # padded samples: the mask is a real input
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    return GPT2LMHeadModel(config), batch, lambda m, b: m(**b).loss


def hf_bert():
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=4096, hidden_size=192, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=768, max_position_embeddings=128, num_labels=4)
    ids = torch.randint(0, config.vocab_size, (32, 128))
    mask = torch.ones_like(ids)
    mask[1::3, -32:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 4, (32,))}
    return BertForSequenceClassification(config), batch, lambda m, b: m(**b).loss


def resnet18():
    import torchvision
    batch = (torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,)))
    return torchvision.models.resnet18(num_classes=10), batch, lambda m, b: F.cross_entropy(m(b[0]), b[1])


def mobilenet_v2():
    import torchvision
    batch = (torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,)))
    return torchvision.models.mobilenet_v2(num_classes=10), batch, lambda m, b: F.cross_entropy(m(b[0]), b[1])


MODELS = {
    "Hugging Face GPT2LMHeadModel (4 layers, d 192, batch 16 x 128)": hf_gpt2,
    "Hugging Face BertForSequenceClassification (4 layers, d 192, batch 32 x 128)": hf_bert,
    "torchvision resnet18 (batch 64, 64x64)": resnet18,
    "torchvision mobilenet_v2 (batch 64, 64x64)": mobilenet_v2,
}


def steps_peak(step, batch, budget, steps=3):
    with memfit.budget(budget) as b:
        for _ in range(steps):
            step(batch)
    return b.peak_bytes


def plain(model, opt, loss_fn):
    def step(b):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def describe(plan):
    where = ", optimizer offloaded" if plan.optimizer_offloaded else ""
    return (f"{plan.micro_batch} x {plan.accumulation}, {plan.precision}, {len(plan.checkpointed)}/"
            f"{len(plan.block_names)} recomputed, {plan.optimizer_state} state{where}")


def row(label, make, fraction):
    torch.manual_seed(0)
    gc.collect()
    model, batch, loss_fn = make()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plain_peak = steps_peak(plain(model, opt, loss_fn), batch, 1 << 40, steps=2)
    budget = int(plain_peak * fraction)
    mib = 1 << 20
    try:  # the user's optimizer, its state made by the plain steps: a plan carries it over
        plan = memfit.plan(model, opt, loss_fn, batch, budget, offload="auto", progress=False)
    except memfit.BudgetError as e:
        return f"| {label} | {fraction:.0%} | {plain_peak / mib:.1f} | {budget / mib:.1f} | none: {e} | | | | NO |"
    step, measured, error = applied_peak(model, opt, plan, batch, budget, peak_of=steps_peak)
    ok = "yes" if measured <= budget and abs(error) <= TOLERANCE and step.oom_splits == 0 else "NO"
    return (f"| {label} | {fraction:.0%} | {plain_peak / mib:.1f} | {budget / mib:.1f} | {describe(plan)} | "
            f"{plan.predicted_peak_bytes / mib:.2f} | {measured / mib:.2f} | {error:+.1%} | {ok} |")


def main():
    names = sys.argv[1:] or list(MODELS)
    print(f"torch {torch.__version__}, memfit built for {memfit.built_torch_version()}, {torch.get_num_threads()} threads")
    print("command: bash bench/python/real_models.sh")
    print("| model | budget | plain peak MiB | budget MiB | plan | predicted MiB | measured MiB | error | fits, within 3%, no OOM |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    failed = 0
    for label, make in MODELS.items():
        if not any(n in label for n in names):
            continue
        for fraction in FRACTIONS:
            line = row(label, make, fraction)
            failed += line.endswith("NO |")
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
