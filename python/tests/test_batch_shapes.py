"""Every batch a DataLoader gives: each planned from its shape before it runs (plan/batch_shape.h).
A plan made on 16 x 64 tokens then trains on batches padded to their longest sequence (16 to
128 tokens) and a short last batch, under the plan's budget: no step needs an out-of-memory
recovery, each is predicted closely, and each step's loss and update are plain training's. The
same for an encoder-decoder whose source and target lengths vary on their own, and for images
whose sides vary (planned by their pixels)."""
import copy

import numpy as np
import torch

import memfit
from models import CNN, GPT, Seq2Seq, cnn_batch, cnn_loss, gpt_batch, gpt_loss, seq2seq_batch, seq2seq_loss
from test_plan_apply import plain_step

L0, B = 64, 16


def padded_batches(count, seed=1):
    """(samples, length) of a DataLoader padding each batch to its longest: lengths drawn from a
    quarter of to twice the planned one, the last batch short."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, int(torch.randint(L0 // 4, 2 * L0 + 1, (1,), generator=g))) for _ in range(count - 1)]
    return shapes + [(5, L0 // 2)]


def test_batches_of_other_lengths_are_planned_before_they_run_and_train_as_plain():
    torch.manual_seed(0)
    model = GPT(seq=2 * L0, layers=4, d=64, dropout=0.0)
    shapes = padded_batches(10)
    planned = run_planned_and_compare(model, gpt_loss, gpt_batch(B, L0),
                                      lambda i: gpt_batch(*shapes[i], seed=100 + i), len(shapes), tolerance=0.05)
    assert planned["length"] == L0 and planned["longest"] > L0


def test_an_encoder_decoder_batch_is_planned_by_the_length_grown_most():
    """Source and target of their own lengths (an encoder-decoder's padded batches): each batch
    planned as if both had grown as much as the one grown most, an upper bound of its peak."""
    torch.manual_seed(0)
    model = Seq2Seq()
    source, target = 48, 32
    g = torch.Generator().manual_seed(2)
    shapes = [(B, int(torch.randint(source // 4, 2 * source + 1, (1,), generator=g)),
               int(torch.randint(target // 4, 2 * target + 1, (1,), generator=g))) for _ in range(7)]
    shapes += [(B, 2 * source, target // 2), (B, source // 2, 2 * target), (5, source, target)]
    planned = run_planned_and_compare(model, seq2seq_loss, seq2seq_batch(B, source, target),
                                      lambda i: seq2seq_batch(*shapes[i], seed=100 + i), len(shapes), tolerance=None)
    assert planned["length"] == source  # the longest of the planned batch's lengths


def test_images_of_other_sizes_are_planned_by_their_pixels():
    """Multi-scale training: images with sides drawn so their pixels run from a quarter of to
    twice the planned 64 x 64's, and a short last batch: each batch planned by its pixels before
    it runs, predicted closely, trained as plain (GroupNorm: micro-batches are exact)."""
    torch.manual_seed(0)
    model = CNN(channels=16, blocks=4, norm=lambda c: torch.nn.GroupNorm(4, c))
    side, samples = 64, 8
    g = torch.Generator().manual_seed(3)
    shapes = [(samples, int(torch.randint(side // 2, int(side * 2 ** 0.5) + 1, (1,), generator=g))) for _ in range(6)]
    shapes += [(samples, int(side * 2 ** 0.5)), (3, side)]
    # tolerance None: never over the prediction by 1%, under it by any share. At two samples per
    # micro-batch every size from 16 x 16 to 128 x 128 is predicted within 1%; at one, the peak is
    # not smooth in the pixels (40 x 40 keeps 2.63 MB, 32 x 32 2.26 and 48 x 48 3.64), and the
    # quadratic through the profiled sizes over-predicts the largest images (90 x 90: by 18%).
    planned = run_planned_and_compare(model, cnn_loss, cnn_batch(samples, side),
                                      lambda i: cnn_batch(*shapes[i], seed=100 + i), len(shapes), tolerance=None)
    assert planned["length"] == side * side and planned["longest"] > side * side


def shapes_of(batch):
    return [tuple(t.shape) for t in memfit._batch.tensors(batch)]


def run_planned_and_compare(model, loss_fn, planned_batch, batch_at, count, tolerance):
    """Plans `model` on `planned_batch` at 45% of its plain peak, then steps on `count` batches
    (batch_at(i), made as each runs: the batches are not alive under the budget together), each
    compared with plain training from the same weights and state. Every step fits the budget
    with no out-of-memory recovery and never above its prediction by more than 1%; within
    `tolerance` of it both ways where given. Returns plan.batches()."""
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = copy.deepcopy(model)
    probe_opt = torch.optim.AdamW(probe.parameters(), lr=1e-3)
    with memfit.budget(1 << 40) as b:
        for _ in range(2):
            plain_step(probe, probe_opt, loss_fn, planned_batch)
    budget = int(b.peak_bytes * 0.45)
    del probe, probe_opt
    # fp32 only, state too: the comparison is with plain fp32 AdamW step for step (a bf16 plan,
    # chosen where the machine runs it faster, or 8-bit moments would drift from it).
    plan = memfit.plan(model, opt, loss_fn, planned_batch, budget, precisions=("fp32",), optimizer_state="fp32",
                       progress=False)
    assert "each planned before it runs" in str(plan)
    del planned_batch  # each step's batch is the one the budget counts (an image batch is large)
    step = memfit.apply(model, opt, plan)
    choices = set()
    try:
        for i in range(count):
            batch = batch_at(i)
            expected_loss, expected_update = plain_step_from(model, opt, reference, batch, loss_fn)
            before = numpy_of(opt.param_groups[0]["params"])
            with memfit.budget(budget) as b:
                loss = step(batch)
            chosen = step.last_choice
            choices.add((chosen["micro_batch"], tuple(chosen["segments"])))
            shape = shapes_of(batch)
            assert b.peak_bytes <= budget, f"{shape}: {b.peak_bytes} > budget {budget}"
            error = (b.peak_bytes - chosen["predicted_peak_bytes"]) / chosen["predicted_peak_bytes"]
            # The first step makes the optimizer's state only at its end: below its prediction.
            within = error <= 0.01 if tolerance is None or i == 0 else abs(error) <= tolerance
            assert within, f"{shape}: measured {b.peak_bytes}, predicted {chosen} ({error:+.2%})"
            assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss), f"step {i}: loss {loss} vs plain {expected_loss}"
            update = numpy_of(opt.param_groups[0]["params"]) - before
            miss = np.linalg.norm(update - expected_update) / np.linalg.norm(expected_update)
            assert miss <= 1e-3, f"step {i} ({chosen['micro_batch']} per micro-batch): update off plain's by {miss:.2e}"
    finally:
        memfit.remove(model)
    assert step.oom_splits == 0
    assert len(choices) > 1  # the shapes were not all run as the plan's one batch
    return plan.batches()


def plain_step_from(model, opt, reference, batch, loss_fn):
    """Plain training's loss and parameter update for one step from where `model` and `opt` stand
    now: compared step by step, float rounding in one step is not amplified by the next ones. What
    it keeps is in numpy's memory, outside the budget the steps run under."""
    ref_params = list(reference.parameters())
    with torch.no_grad():
        for r, p in zip(ref_params, opt.param_groups[0]["params"]):
            r.copy_(p)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-3)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    before = numpy_of(ref_params)
    loss = plain_step(reference, ref_opt, loss_fn, batch)
    return loss, numpy_of(ref_params) - before


def numpy_of(params):
    return np.concatenate([p.detach().numpy().ravel() for p in params])

def test_a_batch_without_a_length_is_planned_by_its_samples():
    from models import make
    model, batch, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, opt, loss_fn, batch, 1 << 30, progress=False)
    assert plan.batches()["length"] is None
    step = memfit.apply(model, opt, plan)
    try:
        step(batch)
        step((batch[0][:700], batch[1][:700]))  # a short last batch
        assert step.last_choice["feasible"] and step.last_choice["micro_batch"] <= 700
    finally:
        memfit.remove(model)


def test_an_image_batch_is_cut_and_measured_by_its_pixels():
    """An image and its segmentation mask share their sides: both are cut alike, to sides that
    keep their power-of-two divisibility (a U-Net's pooled maps meet its skips again), and a
    batch's length is its pixels on the planned batch's scale."""
    image, mask, label = torch.zeros(8, 3, 64, 96), torch.zeros(8, 64, 96, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    lengths = memfit._batch.Lengths((image, mask, label))
    assert lengths.longest == 64 * 96 and lengths.unit == "pixels"
    half = lengths.cut((image, mask, label), 64 * 96 // 2)
    assert shapes_of(half) == [(8, 3, 48, 64), (8, 48, 64), (8,)]  # 45.3 -> 48, 67.9 -> 64: multiples of 16
    assert lengths.of(half) == 48 * 64
    assert lengths.of((torch.zeros(2, 3, 90, 100), torch.zeros(2, 90, 100, dtype=torch.long), label[:2])) == 9000
    ids, boxes = torch.zeros(4, 10, dtype=torch.long), torch.zeros(4, 10, 4, dtype=torch.long)
    tokens = memfit._batch.Lengths({"ids": ids, "boxes": boxes, "x": torch.zeros(4, 7)})
    assert tokens.longest == 10 and tokens.unit == "long"  # [B, F] features vary in samples only
    cut = tokens.cut({"ids": ids, "boxes": boxes, "x": torch.zeros(4, 7)}, 5)  # boxes run along the tokens
    assert shapes_of(cut) == [(4, 5), (4, 5, 4), (4, 7)]
