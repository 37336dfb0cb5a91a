"""Builds the native core `torch_openreg._C` from csrc/ with torch.utils.cpp_extension."""
import glob
import os

# Building imports torch; torch's autoload must not import the (installed, possibly stale or
# half-built) torch_openreg while we build it.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources():
    files = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    return files


setup(
    ext_modules=[
        CppExtension(
            name="torch_openreg._C",
            sources=sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args=["-O2", "-Wall", "-Wno-unused-parameter", "-fvisibility=hidden",
                                "-fopenmp-simd"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
