"""The documented examples of memfit inside a trainer run as written (docs/python.md), each
step under its budget."""
import os
import re
import subprocess
import sys

import pytest
import torch

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def run_example(name):
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, name)], capture_output=True, text=True,
                          env={**os.environ, "OMP_WAIT_POLICY": "passive"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    peak, budget, ooms = map(int, re.search(r"highest step peak (\d+) of (\d+) bytes, out-of-memory recoveries (\d+)",
                                            done.stdout).groups())
    assert peak <= budget and ooms == 0, done.stdout[-2000:]


def test_the_hugging_face_trainer_example():
    pytest.importorskip("transformers")
    run_example("hf_trainer.py")


@pytest.mark.skipif(torch.__version__ < "2", reason="lightning's LightningModule needs torch 2.x here")
def test_the_lightning_example():
    pytest.importorskip("lightning")
    run_example("lightning_trainer.py")
