"""The torch releases openreg supports, and what a user gets outside them
(torch_openreg/_native_build.py, docs/torch_releases.md)."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from torch_openreg import _native_build

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_requirement_and_the_loader_name_the_same_range():
    pyproject = (ROOT / "pyproject.toml").read_text()
    rng = _native_build.supported_range()
    assert f'dependencies = ["{rng}"' in pyproject
    assert f'"{rng}", "pyyaml"]' in pyproject
    assert rng == "torch>=2.13,<2.16"


def test_the_installed_torch_is_supported_and_its_build_is_loaded():
    assert _native_build.OLDEST <= _native_build.release(torch.__version__) <= _native_build.NEWEST
    tag = _native_build.build_tag(torch.__version__)
    assert sys.modules["torch_openreg._C"].__name__ == f"torch_openreg._native.{tag}._C"


@pytest.mark.parametrize("version, tag", [("2.15.0+cu132", "torch_2_15_0_cu132"),
                                          ("2.13.0+cpu", "torch_2_13_0_cpu"),
                                          ("2.14.1", "torch_2_14_1")])
def test_build_tags_name_the_exact_version(version, tag):
    assert _native_build.build_tag(version) == tag
    assert _native_build.tag_version(tag) == version


@pytest.mark.parametrize("version", ["2.12.1+cpu", "2.16.0", "3.0.0"])
def test_a_torch_outside_the_range_is_refused_by_name(version):
    with pytest.raises(ImportError) as info:
        _native_build.load(version)
    message = str(info.value)
    assert f"torch {version} is installed" in message
    assert "torch>=2.13,<2.16" in message
    assert "pip install --no-build-isolation" in message


def test_a_build_for_another_torch_names_both_versions_and_the_rebuild():
    other = "2.14.0+rocm9"  # supported, but never built here
    with pytest.raises(ImportError) as info:
        _native_build.load(other)
    message = str(info.value)
    assert f"torch {other} is installed" in message
    built = re.search(r"was built against torch (.*), but torch", message).group(1).split(", ")
    assert torch.__version__ in built  # and the builds for other releases in this tree, if any
    assert f"pip install --no-build-isolation -e {ROOT}" in message


def _copy_package(dest: pathlib.Path, tag: str) -> None:
    """A copy of the package whose only build is filed under ``tag``."""
    shutil.copytree(ROOT / "torch_openreg", dest / "torch_openreg",
                    ignore=shutil.ignore_patterns("_native", "__pycache__"))
    built = pathlib.Path(sys.modules["torch_openreg._C"].__file__)
    (dest / "torch_openreg" / "_native" / tag).mkdir(parents=True)
    shutil.copy(built, dest / "torch_openreg" / "_native" / tag / built.name)


def test_import_torch_with_a_stale_build_says_rebuild_not_undefined_symbol(tmp_path):
    """What a user meets after upgrading torch without rebuilding: `import torch` (autoload) fails
    with both versions and the command, and never reaches the dynamic linker."""
    _copy_package(tmp_path, "torch_2_13_9_cpu")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", "import torch"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "undefined symbol" not in done.stderr
    assert re.search(rf"built against torch 2\.13\.9\+cpu, but torch {re.escape(torch.__version__)}"
                     r" is installed: rebuild it against the installed torch with "
                     r"`pip install --no-build-isolation", done.stderr), done.stderr
    assert "Failed to load the backend extension: torch_openreg" in done.stderr
    # torch's own switch still gives a working torch without the backend
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.ones(2).sum().item())"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2.0"


def test_accelerator_random_gives_the_openreg_generators_seed_and_state():
    """torch 2.14's torch.accelerator.random reads the device's default generator through the
    PrivateUse1 hooks: the same seed and state as torch.openreg's, per device."""
    import torch_behaviour

    if not torch_behaviour.HAS_ACCELERATOR_RANDOM:
        assert not hasattr(torch.accelerator, "random")
        return
    from torch.accelerator import random as acc_random

    torch.openreg.manual_seed_all(1234)
    torch.openreg.manual_seed(77)  # the current device only
    assert acc_random.initial_seed() == torch.openreg.initial_seed() == 77
    torch.rand(5, device="openreg:1")  # moves device 1's state on
    for i in range(torch.openreg.device_count()):
        assert torch.equal(acc_random.get_rng_state(i), torch.openreg.get_rng_state(i))
        assert torch.equal(acc_random.get_rng_state(f"openreg:{i}"),
                           torch.openreg.get_rng_state(i))
    states = acc_random.get_rng_state_all()
    assert len(states) == torch.openreg.device_count()
    assert not torch.equal(states[0], states[1])
    # the state read through torch.accelerator restores the device's stream of numbers
    first = torch.rand(3, device="openreg:1").cpu()
    torch.openreg.set_rng_state(states[1], 1)
    assert torch.equal(torch.rand(3, device="openreg:1").cpu(), first)
