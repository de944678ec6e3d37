"""What the tracker tags each allocation with: the phase of the step (forward, backward,
recompute, optimizer, ...) and a module's index, set from Python as the code runs."""
import contextlib

from memfit._loader import load

_C = load()


@contextlib.contextmanager
def phase(name):
    """The installed tracker's phase is `name` inside the block (no-op without a tracker)."""
    previous = _C.set_phase(name)
    try:
        yield
    finally:
        _C.set_phase(previous)


def set_phase(name):
    """Sets the installed tracker's phase; returns the previous one."""
    return _C.set_phase(name)


def set_tag(index):
    """Tags the installed tracker's next allocations with `index` (-1: none); returns the previous tag."""
    return _C.set_tag(index)
