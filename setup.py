"""Builds the native core `torch_openreg._C` from csrc/ with torch.utils.cpp_extension.

The build is named after the torch it is compiled against (torch_openreg/_native_build.py), so
builds for several torch releases live side by side in one tree, each with its own object files.
"""
import glob
import importlib.util
import os
import subprocess

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


# torch's headers, parsed once per build instead of once per source file: GCC's precompiled header
# (build/<TAG>/pch), passed to every file with -include. Each of the ~30 files spends most of its
# time in these headers; see CONTRIBUTING.md for the measured build times. Another compiler, or a
# header GCC finds stale (-Winvalid-pch says so), just parses the headers as before.
PCH_HEADERS = ["ATen/ATen.h", "torch/library.h"]


def is_gcc(compiler):
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "Free Software Foundation" in out and "clang" not in out


class BuildNative(BuildExtension.with_options(use_ninja=True)):
    """Object files per torch release too (build/temp.*/<TAG>): switching between the virtual
    environments of two releases rebuilds only what changed."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(self.build_temp, TAG)

    def build_extension(self, ext):
        # BuildExtension.build_extensions has added torch's flags to ext.extra_compile_args by now
        header = "-Winvalid-pch" not in ext.extra_compile_args and self.precompile_headers(ext)
        if header:
            ext.extra_compile_args = ext.extra_compile_args + ["-include", header, "-Winvalid-pch"]
        super().build_extension(ext)

    def precompile_headers(self, ext):
        """build/<TAG>/pch/openreg_pch.h and its .gch, compiled with the flags of ext's sources
        (the compile command of torch's ninja file: Python's flags, include dirs, ext's flags)."""
        compiler = self.compiler.compiler_so
        if os.environ.get("OPENREG_PCH") == "0" or not is_gcc(compiler[0]):
            return None
        folder = os.path.join(ROOT, "build", TAG, "pch")
        os.makedirs(folder, exist_ok=True)
        header = os.path.join(folder, "openreg_pch.h")
        text = "".join(f"#include <{h}>\n" for h in PCH_HEADERS)
        includes = [f"-I{os.path.abspath(d)}" for d in ext.include_dirs + self.compiler.include_dirs]
        command = compiler + includes + ["-x", "c++-header", header, "-o", header + ".gch"] + \
            ext.extra_compile_args
        line, stamp = " ".join(command), os.path.join(folder, "command.txt")

        def read(path):
            with open(path) as f:
                return f.read()

        if os.path.exists(header + ".gch") and os.path.exists(stamp) and read(stamp) == line and \
                read(header) == text:
            return header
        with open(header, "w") as f:
            f.write(text)
        print("precompiling torch's headers:", line, flush=True)
        if subprocess.run(command).returncode != 0:
            print("precompiled header failed: every file parses torch's headers", flush=True)
            return None
        with open(stamp, "w") as f:
            f.write(line)
        return header

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
                                "-fopenmp-simd", DEBUG_INFO,
                                # torch 2.13-2.15's headers need C++20 (torch adds it when no
                                # -std is given; explicit here, so the precompiled header has it)
                                "-std=c++20"],
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
