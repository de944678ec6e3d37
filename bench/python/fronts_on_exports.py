"""One model through both fronts: the user's nn.Module given to `memfit.plan` (Python), and its
TorchScript export given to `memfit plan --model` (the CLI). Models from
bench/harness/foreign_models.py: torchvision's ResNet-18 cut into a Sequential of its stages,
and a GPT-2 after Hugging Face's (Conv1D projections, tied embeddings; the CLI gets each block
traced, Python the eager blocks). Both fronts with AdamW, optimizer state auto and offload auto.
At 60/45/30% of each front's own plain step peak: the plan, its predicted peak, the peak its
steps measured under the budget, and the error. Prints one markdown table; exits 1 if a plan
went over its budget, missed its prediction by more than 3% either way, or a front found none.

    IMAGE=128 .venv-py/bin/python bench/python/fronts_on_exports.py build/memfit [resnet18] [gpt2]
"""
import gc
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

import memfit

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "harness"))
sys.path.insert(0, here)
import foreign_models  # noqa: E402
from real_models import describe, plain, steps_peak  # noqa: E402
from unnamed_models import applied_peak  # noqa: E402

FRACTIONS = (0.6, 0.45, 0.3)
TOLERANCE = 0.03
MIB = 1 << 20


def image_loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def token_loss(model, batch):
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())  # the CLI's --loss cross-entropy


# name: (eager model, exported model, data, batch, loss)
MODELS = {
    "resnet18": (foreign_models.resnet18, foreign_models.resnet18, foreign_models.image_data, 32, image_loss),
    "gpt2": (foreign_models.gpt2_eager, foreign_models.gpt2_traced, foreign_models.gpt_data, 16, token_loss),
}


def cli_plan(cli, d, batch, budget, *flags):
    """`memfit plan` on the export, verified: (plan JSON) or raises with its last error line."""
    run = subprocess.run([cli, "plan", "--model", f"{d}/model.pt", "--data", f"{d}/data.pt", "--batch", str(batch),
                          "--budget", str(budget), "--optimizer", "adamw", "--profile-cache", f"{d}/cache", "--json",
                          *flags], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(run.stderr.strip().splitlines()[-1])
    return json.loads(run.stdout)


def cli_rows(cli, name, d):
    _, export, data, batch, _ = MODELS[name]
    torch.manual_seed(0)
    torch.jit.script(export().train()).save(f"{d}/model.pt")
    torch.save(data(), f"{d}/data.pt")
    plain = cli_plan(cli, d, batch, "1TiB", "--precision", "fp32", "--micro-batch", str(batch), "--checkpoint", "none",
                     "--optimizer-state", "fp32")["measured"]["peak_bytes"]
    for fraction in FRACTIONS:
        budget = int(plain * fraction)
        try:
            j = cli_plan(cli, d, batch, budget, "--offload", "auto")
        except RuntimeError as e:
            yield fraction, plain, budget, f"none: {e}", None, None
            continue
        c = j["config"]
        offloaded = ", optimizer offloaded" if c.get("offload", {}).get("optimizer") else ""
        plan = (f'{c["micro_batch"]} x {c["batch"] // c["micro_batch"]}, {c["precision"]}, '
                f'{len(c["recomputed_blocks"])} recomputed, {c["optimizer"]["state"]} state{offloaded}')
        yield fraction, plain, budget, plan, j["predicted"]["peak_bytes"], j["measured"]["peak_bytes"]


def python_row(name, fraction):
    """One budget's row from the Python front, everything made afresh (and gone after)."""
    eager, _, data, batch_size, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = eager().train()
    d = data()
    batch = (d["inputs"][:batch_size].clone(), d["targets"][:batch_size].clone())
    del d
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plain_peak = steps_peak(plain(model, opt, loss_fn), batch, 1 << 40, steps=2)
    budget = int(plain_peak * fraction)
    try:
        plan = memfit.plan(model, opt, loss_fn, batch, budget, offload="auto", progress=False)
    except memfit.BudgetError as e:
        return fraction, plain_peak, budget, f"none: {str(e).splitlines()[0]}", None, None
    _, measured, _ = applied_peak(model, opt, plan, batch, budget, peak_of=steps_peak)
    return fraction, plain_peak, budget, describe(plan), plan.predicted_peak_bytes, measured


def python_rows(name):
    for fraction in FRACTIONS:
        gc.collect()  # the last row's model and optimizer gone before this one's are measured
        yield python_row(name, fraction)


def line(name, front, row):
    fraction, plain, budget, plan, predicted, measured = row
    if predicted is None:
        return f"| {name} | {front} | {fraction:.0%} | {plain / MIB:.1f} | {budget / MIB:.1f} | {plan} | | | | NO |"
    error = (measured - predicted) / predicted
    ok = "yes" if measured <= budget and abs(error) <= TOLERANCE else "NO"
    return (f"| {name} | {front} | {fraction:.0%} | {plain / MIB:.1f} | {budget / MIB:.1f} | {plan} | "
            f"{predicted / MIB:.2f} | {measured / MIB:.2f} | {error:+.2%} | {ok} |")


def main():
    cli = os.path.abspath(sys.argv[1])
    names = sys.argv[2:] or list(MODELS)
    print(f"torch {torch.__version__}, memfit built for {memfit.built_torch_version()}, {torch.get_num_threads()} threads, "
          f"images {foreign_models.IMAGE} px")
    print(f"command: IMAGE={foreign_models.IMAGE} python bench/python/fronts_on_exports.py MEMFIT_CLI {' '.join(names)}")
    print("| model | front | budget | plain peak MiB | budget MiB | plan | predicted MiB | measured MiB | error | fits, within 3% |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    failed = 0
    for name in names:
        with tempfile.TemporaryDirectory() as d:
            for front, rows in (("CLI (TorchScript)", cli_rows(cli, name, d)), ("Python (nn.Module)", python_rows(name))):
                for row in rows:
                    text = line(name, front, row)
                    failed += text.endswith("NO |")
                    print(text, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
