"""Loads memfit._C after checking that it was built for the torch running now.

The extension links the LibTorch of the torch it was compiled against; loaded into another
version's process it would fail on missing symbols (or worse, mismatch silently), so the version
recorded at build time is compared first.
"""
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REINSTALL = ("reinstall memfit against this torch: `pip install --force-reinstall --no-deps .` "
              "from memfit's source folder")


def built_torch_version():
    """The torch version memfit._C was built against, or None if the build left no record."""
    try:
        with open(os.path.join(_HERE, "_C.torch_version")) as f:
            return f.read().strip()
    except OSError:
        return None


def load():
    """Returns the extension module, or raises ImportError saying what to do."""
    built = built_torch_version()
    if built is not None and built != torch.__version__:
        raise ImportError("memfit was built for torch " + built + " but this is torch " + torch.__version__ + ": " +
                          _REINSTALL)
    try:
        from memfit import _C
    except ImportError as e:
        raise ImportError("memfit's C++ extension does not load (" + str(e).splitlines()[0] + "): " + _REINSTALL) from e
    return _C
