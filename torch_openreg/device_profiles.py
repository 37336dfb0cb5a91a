"""Device profiles: openreg behaving as a device with fewer dtypes (docs/device_profiles.md).

Apple's MPS has no float64, and other accelerators have no complex or no bfloat16 dtypes. Code
that creates such a tensor on the device works on the CPU and on CUDA, and fails on those
devices. A profile makes openreg refuse the same dtypes, so such code fails in a CPU-only CI::

    OPENREG_DEVICE_PROFILE=mps python -m pytest ...          # no float64 (nor complex128)
    OPENREG_DEVICE_PROFILE=no-complex,no-bfloat16 python ...  # combined

or, in the program, before the first use of an openreg device::

    torch.openreg.set_device_profile("no-float64")

Every device tensor is born in the native core (the ``empty``/``empty_strided`` kernels, the
results of the CPU kernels the fallback runs): a refused dtype raises a TypeError there, naming
the dtype, the device and the profile, before the tensor exists.
"""

from __future__ import annotations

import os

import torch

from torch_openreg import _C

__all__ = ["set_device_profile", "get_device_profile", "is_dtype_supported", "PROFILES"]

_ENV = "OPENREG_DEVICE_PROFILE"

# [docs:start PROFILES]
# Named profiles: the dtypes each one refuses. A profile string is a comma-separated list of these
# names and of "no-<dtype>" for any other torch dtype ("no-float16", "no-float8_e4m3fn").
_COMPLEX = ["complex32", "complex64", "complex128"]
PROFILES: dict[str, list[str]] = {
    # Apple's MPS: "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't
    # support float64". complex128 is made of float64 values and is refused with it.
    "mps": ["float64", "complex128"],
    "no-float64": ["float64", "complex128"],
    "no-complex": _COMPLEX,
    "no-bfloat16": ["bfloat16"],
    "no-float8": [n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                              "float8_e8m0fnu") if isinstance(getattr(torch, n, None), torch.dtype)],
}
# What the error suggests instead of a refused dtype (if the profile keeps it).
_INSTEAD = {
    "float64": "float32",
    "complex128": "complex64",
    "bfloat16": "float16",
    "complex64": "real tensors (torch.view_as_real)",
    "complex32": "real tensors (torch.view_as_real)",
}
# [docs:end PROFILES]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse(profile: str) -> list[torch.dtype]:
    refused: list[torch.dtype] = []
    for token in (t.strip() for t in profile.split(",")):
        if not token:
            continue
        if token in PROFILES:
            names = PROFILES[token]
        elif token.startswith("no-") and isinstance(getattr(torch, token[3:], None), torch.dtype):
            names = [token[3:]]
        else:
            raise ValueError(
                f"unknown device profile {token!r} in {profile!r}: expected a comma-separated "
                f"list of {', '.join(sorted(PROFILES))} or no-<dtype> (for example no-float16)"
            )
        for name in names:
            dtype = getattr(torch, name)
            if dtype not in refused:
                refused.append(dtype)
    return refused


# [docs:start SET_DEVICE_PROFILE]
def set_device_profile(profile: str | None) -> None:
    """Makes every openreg device refuse the dtypes of ``profile`` ("mps", "no-float64",
    "no-complex", "no-bfloat16", "no-float8", "no-<dtype>", comma-separated to combine; None
    or "" for none). Must be called before openreg is initialized, as a device's capabilities
    do not change while tensors exist (RuntimeError otherwise); ``OPENREG_DEVICE_PROFILE`` sets
    it for the whole process."""
    text = ",".join(t.strip() for t in (profile or "").split(",") if t.strip())
    refused = _parse(text)
    entries = []
    for dtype in refused:
        name = _dtype_name(dtype)
        instead = _INSTEAD.get(name, "")
        if instead and not instead.startswith("real") and getattr(torch, instead) in refused:
            instead = ""
        entries.append((dtype, name, instead))
    _C._set_device_profile(text if refused else "", entries)
# [docs:end SET_DEVICE_PROFILE]


def get_device_profile() -> str:
    """The profile in force ("" when openreg supports every dtype its CPU kernels support)."""
    return _C._device_profile()


def is_dtype_supported(dtype: torch.dtype) -> bool:
    """Whether openreg devices can hold tensors of ``dtype`` under the profile in force."""
    return dtype not in _parse(get_device_profile())


def _enable_from_environment() -> None:
    profile = os.environ.get(_ENV, "")
    if profile.strip():
        try:
            set_device_profile(profile)
        except ValueError as e:
            raise ValueError(f"{_ENV}: {e}") from None
