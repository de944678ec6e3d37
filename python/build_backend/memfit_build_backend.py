"""setuptools' PEP 517 backend, with the environment's torch made importable.

memfit's extension must be compiled against the very torch it will run with. pip builds in an
isolated environment that hides the installed packages, and installing torch there would fetch
another copy (gigabytes, and possibly another version). So the build asks the interpreter pip
runs, outside the isolation, where its torch lives, and appends that folder to sys.path: the
build's own setuptools stay first, and setup.py imports the installed torch.
"""
import os
import subprocess
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the PEP 517 hooks)

_ISOLATION_VARIABLES = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONSAFEPATH")
_FIND_TORCH = "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"


def _expose_installed_torch():
    try:
        import torch  # noqa: F401  (visible already: --no-build-isolation)
        return
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in _ISOLATION_VARIABLES}
    found = subprocess.run([sys.executable, "-c", _FIND_TORCH], env=env, capture_output=True, text=True,
                           cwd=os.path.expanduser("~"))
    folder = found.stdout.strip().splitlines()[-1] if found.returncode == 0 and found.stdout.strip() else ""
    if not folder:
        raise RuntimeError(
            "memfit: torch is not installed for " + sys.executable + "; install torch first "
            "(pip install torch, or on Debian 12: python3 -m venv --system-site-packages with python3-torch)")
    if folder not in sys.path:
        sys.path.append(folder)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _expose_installed_torch()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _expose_installed_torch()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _expose_installed_torch()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _expose_installed_torch()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def get_requires_for_build_wheel(config_settings=None):
    _expose_installed_torch()
    return _setuptools.get_requires_for_build_wheel(config_settings)
