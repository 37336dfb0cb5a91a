"""Builds the native core `torch_openreg._C` from csrc/ with torch.utils.cpp_extension.

The build is named after the torch it is compiled against (torch_openreg/_native_build.py), so
builds for several torch releases live side by side in one tree, each with its own object files.
"""
import glob
import importlib.util
import os

# Building imports torch; torch's autoload must not import the (installed, possibly stale or
# half-built) torch_openreg while we build it.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup  # noqa: E402
import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def native_build():
    """torch_openreg/_native_build.py, read by path: importing the package would load the core."""
    spec = importlib.util.spec_from_file_location(
        "_openreg_native_build", os.path.join(ROOT, "torch_openreg", "_native_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TAG = native_build().build_tag(torch.__version__)


# [docs:start CODEGEN]
CODEGEN_YAML = os.path.join("csrc", "routes", "codegen.yaml")
# per torch release: torchgen's output may differ between releases; build/<TAG> is on the include
# path, so csrc includes the header as "generated/..."
GENERATED = os.path.join("build", TAG, "generated")


def generate_registrations():
    """torchgen's external-backend codegen (docs/codegen.md): CODEGEN_YAML -> GENERATED."""
    import torchgen.gen_backend_stubs

    outputs = [os.path.join(ROOT, GENERATED, f)
               for f in ("PrivateUse1NativeFunctions.h", "RegisterPrivateUse1.cpp")]
    inputs = [os.path.join(ROOT, CODEGEN_YAML), torchgen.gen_backend_stubs.__file__]
    if all(os.path.exists(o) for o in outputs) and \
            min(map(os.path.getmtime, outputs)) > max(map(os.path.getmtime, inputs)):
        return  # up to date (torchgen also leaves unchanged files untouched)
    cwd = os.getcwd()
    os.chdir(ROOT)  # the generated code includes its header by the path given here
    try:
        torchgen.gen_backend_stubs.run(CODEGEN_YAML, GENERATED, dry_run=False)
    finally:
        os.chdir(cwd)
    for o in outputs:
        os.utime(o)
# [docs:end CODEGEN]


# Python's own flags (sysconfig) ask for -g. Debug information halves the speed of compiling
# torch's templates (csrc/ops/autocast.cpp: 39 s -> 24 s of CPU, objects 15 MB -> 1 MB), and CI
# builds the core once per torch release: it is off unless OPENREG_DEBUG_INFO=1 (for gdb).
DEBUG_INFO = "-g" if os.environ.get("OPENREG_DEBUG_INFO") == "1" else "-g0"


class BuildNative(BuildExtension.with_options(use_ninja=True)):
    """Object files per torch release too (build/temp.*/<TAG>): switching between the virtual
    environments of two releases rebuilds only what changed."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(self.build_temp, TAG)

    def run(self):
        # an in-place build (build_ext --inplace, pip install -e) copies into this folder
        os.makedirs(os.path.join(ROOT, "torch_openreg", "_native", TAG), exist_ok=True)
        super().run()


def sources():
    generate_registrations()
    files = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    return files + [os.path.join(GENERATED, "RegisterPrivateUse1.cpp")]


setup(
    ext_modules=[
        CppExtension(
            name=f"torch_openreg._native.{TAG}._C",
            sources=sources(),
            # torch/include/kineto: the Kineto plugin headers (csrc/adapters/profiler.cpp)
            include_dirs=[os.path.join(ROOT, "csrc"), ROOT, os.path.join(ROOT, "build", TAG),
                          os.path.join(os.path.dirname(torch.__file__), "include", "kineto")],
            extra_compile_args=["-O2", "-Wall", "-Wno-unused-parameter", "-fvisibility=hidden",
                                "-fopenmp-simd", DEBUG_INFO],
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
