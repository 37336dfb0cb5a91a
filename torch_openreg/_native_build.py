"""Which build of the native core serves the installed torch, and the torch releases supported.

The native core (``torch_openreg._C``) links against libtorch's C++ symbols, which change from
one torch release to the next: a core built against one release cannot load under another. So
each build is kept apart, named after the exact torch it was compiled against
(``torch_openreg/_native/torch_2_15_0_cu132/_C*.so``), and several can sit side by side in one
source tree, one per virtual environment (``make test TORCH=2.13`` next to the default). At
import, this module picks the build of the installed torch and exposes it as
``torch_openreg._C``; instead of the dynamic linker's "undefined symbol", a torch outside the
supported range, or a core built only against other releases, gets an ImportError that names the
versions and the command that fixes it (docs/torch_releases.md).

This file is also read by setup.py (by path, without importing the package), so that the build
and the loader agree on the name; it imports nothing of torch_openreg.
"""

from __future__ import annotations

import glob
import importlib
import itertools
import os
import re
import sys

# [docs:start SUPPORTED_RELEASES]
# The torch releases this source tree supports: torch>=2.13,<2.16 (also pyproject.toml's
# requirement; tests/test_torch_releases.py keeps the two equal).
OLDEST = (2, 13)
NEWEST = (2, 15)
# [docs:end SUPPORTED_RELEASES]

_HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE_DIR = os.path.join(_HERE, "_native")
_SOURCE_ROOT = os.path.dirname(_HERE)


def release(version: str) -> tuple[int, int]:
    """``"2.15.0+cu132"`` -> ``(2, 15)``."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def build_tag(version: str) -> str:
    """The folder of the build against torch ``version``: ``"2.15.0+cu132"`` ->
    ``"torch_2_15_0_cu132"`` (the exact version: local tags such as +cpu and +cu132 included)."""
    return "torch_" + re.sub(r"[^0-9A-Za-z]+", "_", str(version)).strip("_")


def supported_range() -> str:
    return f"torch>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}"


def _install_command() -> str:
    if os.path.exists(os.path.join(_SOURCE_ROOT, "setup.py")):  # an editable install or a checkout
        return f"pip install --no-build-isolation -e {_SOURCE_ROOT}"
    return "pip install --no-build-isolation --force-reinstall --no-deps torch-openreg"


def tag_version(tag: str) -> str:
    """The version a build folder is named after: ``"torch_2_15_0_cu132"`` -> ``"2.15.0+cu132"``."""
    parts = tag[len("torch_"):].split("_")
    release = list(itertools.takewhile(str.isdigit, parts))
    local = parts[len(release):]
    return ".".join(release) + ("+" + ".".join(local) if local else "")


def _built_versions() -> list[str]:
    """The torch versions that builds in this tree were made against, as their folder names say."""
    return sorted(tag_version(os.path.basename(os.path.dirname(p)))
                  for p in glob.glob(os.path.join(NATIVE_DIR, "torch_*", "_C*.so")))


def load(torch_version: str | None = None):
    """Imports the native core built against ``torch_version`` (default: the installed torch's)
    and registers it as ``torch_openreg._C``; raises ImportError saying what to do when there is
    none."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    if not OLDEST <= release(torch_version) <= NEWEST:
        raise ImportError(
            f"torch_openreg supports {supported_range()}, but torch {torch_version} is installed. "
            f"Install a supported torch (pip install '{supported_range()}'), then rebuild "
            f"torch_openreg against it: "
            f"{_install_command()}"
        )
    tag = build_tag(torch_version)
    if not glob.glob(os.path.join(NATIVE_DIR, tag, "_C*.so")):
        others = _built_versions()
        built = (f"was built against torch {', '.join(others)}" if others
                 else "has not been built")
        raise ImportError(
            f"torch_openreg's native core {built}, but torch {torch_version} is installed: "
            f"rebuild it against the installed torch with `{_install_command()}`"
        )
    module = importlib.import_module(f"torch_openreg._native.{tag}._C")
    sys.modules["torch_openreg._C"] = module
    return module
