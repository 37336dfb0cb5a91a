"""Builds minidev's native part in place: `python setup.py build_ext --inplace` (nothing installed).

No `torch.backends` entry point on purpose: minidev is imported explicitly (`import minidev`), so it
never competes with an autoloaded backend (openreg) for PrivateUse1.
"""
# [docs:start SETUP]
import os

# torch must not autoload another backend (openreg) while this builds
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

setup(
    name="minidev",
    packages=["minidev"],
    ext_modules=[
        CppExtension("minidev._C", ["minidev.cpp"], extra_compile_args=["-O2"]),
        # optional mechanisms, an extension each (minidev does without any of them)
        CppExtension("minidev._autocast", ["optional/autocast.cpp"], extra_compile_args=["-O2"]),
        CppExtension("minidev._pinned_memory", ["optional/pinned_memory.cpp"],
                     extra_compile_args=["-O2"]),
        CppExtension("minidev._fork", ["optional/fork.cpp"], extra_compile_args=["-O2"]),
        CppExtension("minidev._distributed", ["optional/distributed.cpp"],
                     extra_compile_args=["-O2"]),
        # Kineto's headers are empty without USE_KINETO; libtorch exports none of fmt's functions;
        # RecordFunction::inputs() asserts a flag that only a debug libtorch sets without NDEBUG
        CppExtension("minidev._profiler", ["optional/profiler.cpp"], extra_compile_args=["-O2"],
                     define_macros=[("USE_KINETO", None), ("FMT_HEADER_ONLY", None),
                                    ("NDEBUG", None)],
                     include_dirs=[os.path.join(os.path.dirname(torch.__file__), "include",
                                                "kineto")])],
    cmdclass={"build_ext": BuildExtension},
)
# [docs:end SETUP]
