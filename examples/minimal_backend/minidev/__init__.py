"""minidev: the smallest PrivateUse1 backend (docs/first_backend.md walks through it).

`import minidev` registers the device `minidev` (two devices, simulated on the CPU) and makes this
package its device module, `torch.minidev`. No autoload entry point: import it explicitly. On the
Python side it leaves out lazy initialisation, device properties and most of torch.cuda's API
(openreg's complete device module: docs/device.md, docs/accelerator.md); minidev.cpp says what the
native side leaves out.
"""
import importlib.util
import os
import sys

import torch

from . import _C  # loading the native part registers the allocator, guard, hooks and kernels

acc = torch.accelerator  # the C++ side serves torch.accelerator: most of the module forwards to it


# [docs:start DEVICE_MODULE]
def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    return _C.device_count()


def _index(device) -> int:
    """The index of an int, a str or a torch.device; None is the current device."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return acc.current_device_index() if index is None else index


def device(device):
    """``with torch.minidev.device(d):`` (torch.load passes a torch.device)."""
    return acc.device_index(_index(device))


def is_initialized() -> bool:
    return True  # nothing is initialised lazily


def get_device_name(device=None) -> str:
    return "minidev (simulated on the CPU)"


def _is_in_bad_fork() -> bool:  # torch.manual_seed seeds the device only if this exists
    return False


current_device, set_device = acc.current_device_index, acc.set_device_index
synchronize = acc.synchronize
# [docs:end DEVICE_MODULE]


# [docs:start STREAMS]
class Stream(torch.Stream):
    def __new__(cls, device=None, priority=0, **kwargs):
        if "stream_id" in kwargs:  # torch rebuilding a stream from its ids
            return super().__new__(cls, **kwargs)
        device = torch.device("minidev", _index(device))
        return super().__new__(cls, device=device, priority=priority)


class Event(torch.Event):
    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        return super().__new__(cls, device="minidev", enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)


def default_stream(device=None) -> torch.Stream:
    return torch.Stream(stream_id=0, device_index=_index(device),
                        device_type=acc.current_stream().device_type)


def stream(stream: torch.Stream) -> torch.Stream:
    return stream  # `with torch.minidev.stream(s):`: a torch.Stream is its own context manager


current_stream, set_stream = acc.current_stream, acc.set_stream
# [docs:end STREAMS]

# [docs:start MEMORY]
memory_allocated, max_memory_allocated = acc.memory_allocated, acc.max_memory_allocated
memory_reserved, max_memory_reserved = acc.memory_reserved, acc.max_memory_reserved
memory_stats, reset_peak_memory_stats = acc.memory_stats, acc.reset_peak_memory_stats
empty_cache = acc.empty_cache
# [docs:end MEMORY]


# [docs:start RANDOM]
default_generators = tuple(_C.default_generator(i) for i in range(device_count()))


def manual_seed(seed: int) -> None:
    default_generators[_index(None)].manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:  # torch.manual_seed calls it
    for generator in default_generators:
        generator.manual_seed(int(seed))


def seed() -> None:
    default_generators[_index(None)].seed()


def initial_seed() -> int:
    return default_generators[_index(None)].initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    return default_generators[_index(device)].get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    default_generators[_index(device)].set_state(state)
# [docs:end RANDOM]


# [docs:start REGISTRATION]
torch.utils.rename_privateuse1_backend("minidev")
torch._register_device_module("minidev", sys.modules[__name__])  # this package
torch.utils.generate_methods_for_privateuse1_backend(
    for_tensor=True, for_module=True, for_storage=True)
# [docs:end REGISTRATION]


# [docs:start OPTIONAL]
# Optional mechanisms, a file each in optional/: setup.py builds the C++ ones as minidev._<name>,
# the Python ones are imported from optional/ as minidev.<name>. One that is not there is left out.
__path__.append(os.path.join(os.path.dirname(__file__), os.pardir, "optional"))
for _name in ("_autocast", "_pinned_memory", "_fork", "inductor", "_distributed", "_profiler"):
    if importlib.util.find_spec(f"{__name__}.{_name}") is not None:
        importlib.import_module(f"{__name__}.{_name}")  # loading it registers the mechanism
if "_autocast" in globals():  # the AutocastPrivateUse1 kernels are registered
    def get_amp_supported_dtype() -> list:  # the dtypes torch.autocast("minidev") accepts
        return [torch.float16, torch.bfloat16]
# [docs:end OPTIONAL]
