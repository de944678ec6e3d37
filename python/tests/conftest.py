import os
import sys

import memfit  # noqa: F401  (first: its allocator then counts every tensor the tests make)
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
    yield
