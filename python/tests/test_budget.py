"""memfit.budget: a hard CPU budget raising the GPU's out-of-memory error; sizes as text."""
import pytest
import torch

import memfit


def oom_type():
    return getattr(torch.cuda, "OutOfMemoryError", RuntimeError)


def test_an_allocation_past_the_budget_raises_out_of_memory_and_the_process_goes_on():
    keep = torch.zeros(1 << 20)  # 4 MiB
    base = memfit.allocated_bytes()
    with memfit.budget(base + (1 << 20)):
        small = torch.zeros(1 << 16)
        with pytest.raises(oom_type(), match="out of memory"):
            torch.zeros(1 << 20)
        del small
    assert torch.zeros(1 << 20).sum().item() == 0  # usable after, without the budget
    del keep


def test_a_step_past_the_budget_fails_in_backward_then_runs_under_a_larger_one():
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    x = torch.randn(512, 512)
    base = memfit.allocated_bytes()
    with pytest.raises(oom_type()):
        with memfit.budget(base + (2 << 20)):
            model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    with memfit.budget(base + (64 << 20)) as b:
        model(x).sum().backward()
    assert 0 < b.peak_bytes <= base + (64 << 20)


@pytest.mark.parametrize("text,expected", [("2GiB", 2 << 30), ("800MB", 800_000_000), ("1.5KiB", 1536), (4096, 4096)])
def test_sizes(text, expected):
    assert memfit.budget(text).bytes == expected
    assert memfit.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["2 gigs", "", -5, 0, None, 1.5])
def test_a_bad_size_is_one_value_error_naming_the_budget(bad):
    with pytest.raises(ValueError, match="^budget"):
        memfit.budget(bad)


def test_budgets_nest_and_restore():
    with memfit.budget("1GiB"):
        with memfit.budget("2GiB"):
            torch.zeros(10)
        torch.zeros(10)
    torch.zeros(1 << 22)


def test_an_outer_budget_peak_counts_what_came_before_and_inside_an_inner_one():
    """An inner budget resets the allocator's peak; the outer's peak_bytes is still its block's."""
    big, small = 4 << 20, 1 << 20
    with memfit.budget("1GiB") as outer:
        base = memfit.allocated_bytes()
        x = torch.empty(big, dtype=torch.uint8)
        del x
        with memfit.budget("1GiB") as inner:
            y = torch.empty(small, dtype=torch.uint8)
            del y
    assert inner.peak_bytes == base + small
    assert outer.peak_bytes == base + big
