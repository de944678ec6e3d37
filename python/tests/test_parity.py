"""One model from both fronts: a Python nn.Module given to memfit.plan, and its TorchScript export
given to the CLI's `memfit plan`. Each front measures the model its own way (Python by hooks on
the user's module, the CLI by running each block alone), so the bytes they hand the one C++
planner must agree, and so must the plans it makes from them."""
import glob
import json
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit._loader import load

_C = load()

BATCH = 32
BYTES_AGREE = 8  # the loss: a 4-byte scalar the fronts place on either side of the last block


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())  # as the CLI's --loss cross-entropy


def _cli():
    """The CLI built against this torch: MEMFIT_CLI (CI sets it), or the checkout's build."""
    if os.environ.get("MEMFIT_CLI"):
        return os.environ["MEMFIT_CLI"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    version = "LibTorch " + ".".join(torch.__version__.split(".")[:2])
    for build in ("build", "build-torch2"):
        path = os.path.join(root, build, "memfit")
        if os.access(path, os.X_OK) and version in subprocess.run([path, "--version"], capture_output=True,
                                                                  text=True).stdout:
            return path
    pytest.skip(f"no memfit CLI built against {version} (MEMFIT_CLI names one)")


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    """The profiles (JSON) both fronts measured, and the optimizer's costs the CLI measured."""
    cli = _cli()
    d = tmp_path_factory.mktemp("parity")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), *[Block(64) for _ in range(4)], nn.Linear(64, 10))
    x, y = torch.randn(80, 16, 32), torch.randint(0, 10, (80, 16))
    torch.jit.script(model).save(str(d / "model.pt"))
    torch.save({"inputs": x, "targets": y}, str(d / "data.pt"))
    run = subprocess.run([cli, "plan", "--model", str(d / "model.pt"), "--data", str(d / "data.pt"), "--batch", str(BATCH),
                          "--precision", "fp32", "--optimizer", "adamw", "--budget", "1GiB", "--no-verify", "--json",
                          "--profile-cache", str(d / "cache")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    (cached,) = glob.glob(str(d / "cache" / "*.json"))
    costs = json.load(open(cached))["costs"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, optimizer, _loss, (x[:BATCH].clone(), y[:BATCH].clone()), "1GiB", blocks=list(model),
                       precisions=("fp32",), optimizer_state="fp32")
    return plan.to_dict()["profile"], costs["profile"], costs["optimizer"][0]


def _planner(profile, optimizer):
    """The C++ planner over a profile, with one request for both fronts. The checkpoint model is
    the CLI's for both: the Python package's non-reentrant checkpoint keeps less in a segment
    (plan/step_costs.cpp), a difference of implementation, not of measurement."""
    profile = dict(profile, non_reentrant_checkpoint=False)
    ask = _C.PlanAsk()
    ask.batch, ask.device, ask.optimizer_family, ask.margin, ask.precisions = BATCH, "cpu", "adamw", 0.0, ["fp32"]
    costs = [_C.OptimizerCost(optimizer["state_bytes"], optimizer["step_bytes"], optimizer["seconds"], "fp32")]
    return _C.Planner(_C.WorkloadProfile.from_json(json.dumps(profile)), _C.set_up_plan(ask).request(costs))


def test_the_blocks_measure_the_same_bytes(fronts):
    py, cli, _ = fronts
    assert (py["weight_bytes"], py["batch_bytes"]) == (cli["weight_bytes"], cli["batch_bytes"])
    # Python's parts: the code before the blocks, the 6 blocks, the loss; the CLI's: the 6 blocks,
    # the loss inside the last. Blocks 0-4 are measured alone by the CLI, in the chain by Python.
    assert len(py["precisions"][0]["large"]["blocks"]) == len(cli["precisions"][0]["large"]["blocks"]) + 2
    fields = ("param_bytes", "output_bytes", "kept_bytes", "forward_peak", "forward_nograd_peak", "output_kept")
    for size in ("small", "large"):
        a, b = py["precisions"][0][size], cli["precisions"][0][size]
        assert a["micro_batch"] == b["micro_batch"]
        for k in range(len(b["blocks"]) - 1):
            assert {f: a["blocks"][k + 1][f] for f in fields} == {f: b["blocks"][k][f] for f in fields}, (size, k)


def _segment_sets(blocks):
    """None, each block alone, and all of them (the CLI's block indices, from 0)."""
    return [[]] + [[(k, k)] for k in range(blocks)] + [[(0, blocks - 1)]]


def test_the_planner_predicts_the_same_peaks_from_both(fronts):
    py, cli, optimizer = fronts
    a, b = _planner(py, optimizer), _planner(cli, optimizer)
    blocks = len(cli["precisions"][0]["large"]["blocks"]) - 1  # the last (with the loss) is never recomputed
    for m in (1, 2, 4, 8, 16, 32):
        for segments in _segment_sets(blocks):
            shifted = [(f + 1, l + 1) for f, l in segments]  # Python's chain has the code before the blocks first
            x = a.evaluate(m, "fp32", shifted, 1 << 40, "fp32")["predicted_peak_bytes"]
            y = b.evaluate(m, "fp32", segments, 1 << 40, "fp32")["predicted_peak_bytes"]
            assert abs(x - y) <= BYTES_AGREE, (m, segments, x, y)


def _with_seconds_of(py, cli):
    """Python's profile with the CLI's seconds: the plans then differ only where the bytes do."""
    py = json.loads(json.dumps(py))
    for a, b in zip(py["precisions"], cli["precisions"]):
        a["chain_seconds"] = b["chain_seconds"]
        for size in ("small", "large", "one_sample"):
            if size not in a or size not in b:
                continue
            a[size]["forward_nograd_seconds"] = b[size]["forward_nograd_seconds"]
            parts, blocks = a[size]["blocks"], b[size]["blocks"]
            for part in (parts[0], parts[-1]):
                part["forward_seconds"] = part["backward_seconds"] = 0.0
            for k, block in enumerate(blocks):
                parts[k + 1]["forward_seconds"] = block["forward_seconds"]
                parts[k + 1]["backward_seconds"] = block["backward_seconds"]
    return py


def test_both_fronts_get_the_same_plan(fronts):
    py, cli, optimizer = fronts
    a, b = _planner(_with_seconds_of(py, cli), optimizer), _planner(cli, optimizer)
    assert abs(a.floor_bytes() - b.floor_bytes()) <= BYTES_AGREE
    plain = b.evaluate(BATCH, "fp32", [], 1 << 40, "fp32")["predicted_peak_bytes"]
    for fraction in (0.9, 0.7, 0.5, 0.35):
        budget = int(plain * fraction)
        x, y = a.plan(budget), b.plan(budget)
        assert x["feasible"] == y["feasible"], (fraction, x, y)
        if not y["feasible"]:
            continue
        assert (x["micro_batch"], x["accumulation"]) == (y["micro_batch"], y["accumulation"]), fraction
        py_segments = [(f - 1, l - 1) for f, l in x["segments"]]
        cli_segments = [tuple(s) for s in y["segments"]]
        if py_segments == cli_segments:
            assert abs(x["predicted_peak_bytes"] - y["predicted_peak_bytes"]) <= BYTES_AGREE, fraction
            continue
        # Two schedules a few bytes apart at the budget's edge: the search's byte slots may round
        # them apart. Each front's plan must then cost the same bytes from the other's profile,
        # and fit the budget there too.
        m = x["micro_batch"]
        x_on_cli = b.evaluate(m, "fp32", py_segments, budget, "fp32")["predicted_peak_bytes"]
        y_on_py = a.evaluate(m, "fp32", [(f + 1, l + 1) for f, l in cli_segments], budget, "fp32")["predicted_peak_bytes"]
        assert abs(x_on_cli - x["predicted_peak_bytes"]) <= BYTES_AGREE, (fraction, py_segments, cli_segments)
        assert abs(y_on_py - y["predicted_peak_bytes"]) <= BYTES_AGREE, (fraction, py_segments, cli_segments)
        assert max(x_on_cli, y_on_py) <= budget + BYTES_AGREE, (fraction, py_segments, cli_segments)
