"""Builds the Python package `memfit` (import memfit) against the torch that is installed.

    pip install .            # from the repository root (see README, "From Python")

The extension `memfit._C` compiles the library's layers the Python package uses (measure/,
techniques/, runtime/, plan/, report/; not train/, zoo/ or cli/) with the bindings in
python/src/, through torch's own extension machinery: the same LibTorch, the same C++ ABI and
the same pybind11 as the running torch, so memfit's allocator and tracker see every allocation
Python makes. Objects go to build-python/torch-<version>/ (kept between builds: ninja rebuilds
only what changed; MAX_JOBS sets its parallelism).

    MEMFIT_LIBRARY=$PWD/build/libmemfit.a pip install .

links the library CMake built against this same torch instead of compiling its sources again,
only the bindings compiled here (CI does this: one build of the library per LibTorch).
"""
import os
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("memfit: building the Python package needs torch installed first (pip install torch, "
             "or Debian's python3-torch in a venv made with --system-site-packages)")

ROOT = os.path.dirname(os.path.abspath(__file__))

# The layers memfit._C compiles (all below train/), from the one list of sources CMake reads too.
PYTHON_LAYERS = {"cuda_model", "shared", "measure", "techniques", "runtime", "plan", "report"}


def library_sources():
    with open(os.path.join(ROOT, "cmake", "sources.txt")) as f:
        rows = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return [path for layer, path in rows if layer in PYTHON_LAYERS]


BINDING_SOURCES = ["python/src/module.cpp"]  # the bind_*.cpp files, as one translation unit


def torch_has_cuda():
    return torch.version.cuda is not None and os.path.exists(
        os.path.join(os.path.dirname(torch.__file__), "lib", "libc10_cuda.so"))


def standard_flags():
    """The C++ standard: torch's extension builder adds the one its headers need where none is
    given (C++17 in 2.x, C++20 from 2.12, whose headers refuse anything older); 1.x's adds C++14,
    below the C++17 memfit is written in."""
    major = int(torch.__version__.split(".")[0])
    return ["-std=c++17"] if major < 2 else []


def prebuilt_library():
    """MEMFIT_LIBRARY: a libmemfit.a CMake built against this torch (position-independent), or None."""
    path = os.environ.get("MEMFIT_LIBRARY")
    if not path:
        return None
    if not os.path.isfile(path):
        sys.exit(f"memfit: MEMFIT_LIBRARY {path!r}: expected the libmemfit.a a CMake build made (no such file)")
    return os.path.abspath(path)


def extension():
    with_cuda = torch_has_cuda()
    prebuilt = prebuilt_library()
    defines = [("MEMFIT_WITH_CUDA", "1" if with_cuda else "0"), ("FMT_HEADER_ONLY", "1"),
               ("PYBIND11_DETAILED_ERROR_MESSAGES", None),  # a type that does not cast says which
               ("MEMFIT_VERSION", '"0.1.0"')]
    libraries = ["crypto"] + (["c10_cuda", "torch_cuda"] if with_cuda else [])
    if prebuilt:
        libraries += ["fmt", "z"]  # the library's own links (CMake: fmt::fmt, ZLIB)
    include_dirs = [os.path.join(ROOT, "include"), os.path.join(ROOT, "src")]
    if with_cuda:
        # The CUDA runtime headers c10/cuda includes: the toolkit's, else the wheel's nvidia package.
        site = os.path.dirname(os.path.dirname(torch.__file__))
        wheel = [os.path.join(site, "nvidia", n) for n in ("cu13", "cu12", "cuda_runtime")]
        for d in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + wheel:
            if d and os.path.exists(os.path.join(d, "include", "cuda_runtime_api.h")):
                include_dirs.append(os.path.join(d, "include"))
                break
    return CppExtension(
        "memfit._C",
        sources=[os.path.relpath(os.path.join(ROOT, s)) for s in (BINDING_SOURCES if prebuilt else
                                                                  library_sources() + BINDING_SOURCES)],
        extra_objects=[prebuilt] if prebuilt else [],
        include_dirs=include_dirs,
        define_macros=defines,
        libraries=libraries,
        # The fused 8-bit Adam rounds as LibTorch's kernels do (no FMA contraction); sqrt without
        # errno lets its loop vectorize (CMakeLists.txt sets the same for that file).
        extra_compile_args=["-O2", "-g0", "-ffp-contract=off", "-fno-math-errno", "-Wno-unused-parameter",
                            "-Wno-sign-compare"] + standard_flags(),
    )


class Build(BuildExtension):
    """torch's BuildExtension, also recording the torch version built against beside the module."""

    def run(self):
        super().run()
        for ext in self.extensions:
            path = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "_C.torch_version")
            with open(path, "w") as f:
                f.write(torch.__version__ + "\n")


build_base = os.path.join("build-python", "torch-" + torch.__version__.replace("+", "-"))
os.makedirs(build_base, exist_ok=True)
setup(
    name="memfit",
    version="0.1.0",
    description="Make PyTorch training fit a memory budget: exact bytes, a planner, the techniques applied",
    packages=["memfit", "memfit.integrations"],
    package_dir={"": "python"},
    ext_modules=[extension()],
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
    options={"build": {"build_base": build_base}, "egg_info": {"egg_base": build_base}},
    python_requires=">=3.9",
    zip_safe=False,
)
