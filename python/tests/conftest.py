import os
import sys

# Before torch loads OpenMP: its threads sleep when idle instead of spinning, which on a
# machine shared with other processes (CI's two cores) slows every op many times over.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# The other two settings the memfit CLI restarts itself to set (the parity test runs it).
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("OMP_DYNAMIC", "FALSE")

import memfit  # noqa: F401  (first: its allocator then counts every tensor the tests make)
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
    yield
