"""minidev's core (examples/minimal_backend, without optional/) with pieces missing or broken the way a first backend has
them, for tests/test_minimal_backend.py: each variant must fail the check that covers the piece.

`MINIDEV_BROKEN=name[,name...]` selects the variants at import: this module imports minidev, then
takes out or replaces one piece per variant from Python (the example itself is not copied or
changed; kernels registered here take the place of minidev's own, as a vendor's would). Variants
that break unrelated pieces can be combined in one process; the test runs only the check each
variant targets.
"""
import os
import sys
import types

import torch

# The variants break the core: minidev's optional mechanisms (examples/minimal_backend/optional)
# are left out, as minidev/__init__.py does when they are not there.
for _optional in ("_autocast", "_pinned_memory", "_fork", "inductor", "_distributed", "_profiler"):
    sys.modules[f"minidev.{_optional}"] = None  # minidev/__init__.py then finds no such module

import minidev  # noqa: E402

DEVICE = "minidev"
_libraries = []  # kept alive: dropping a torch.library.Library unregisters its kernels


def _kernel(op: str, fn, key: str = "PrivateUse1") -> None:
    library = torch.library.Library("aten", "IMPL")
    library.impl(op, fn, key)
    _libraries.append(library)


def _module_with(**changes) -> None:
    """Registers, in minidev's place, a device module with some functions removed (None) or
    replaced: a vendor's module that forgot or got them wrong."""
    full = torch.minidev
    module = types.ModuleType("minidev_broken")
    for name in dir(full):
        if not name.startswith("__"):
            setattr(module, name, getattr(full, name))
    for name, value in changes.items():
        if value is None:
            delattr(module, name)
        else:
            setattr(module, name, value)
    delattr(torch, DEVICE)
    torch._register_device_module(DEVICE, module)


def _not_implemented(op: str):
    def kernel(*args, **kwargs):  # what the dispatcher raises for an operator without a kernel
        raise NotImplementedError(f"Could not run 'aten::{op}' with arguments from the "
                                  f"'{DEVICE}' backend")
    return kernel


# --- one function per variant: name -> what a first backend does -----------------------------------

def no_set_device():  # device_module
    _module_with(set_device=None)


def count_mismatch():  # accelerator: the device module counts devices itself, wrongly
    _module_with(device_count=lambda: 1)


def no_stream_api():  # streams_events: the device module stops at devices and memory
    _module_with(**{n: None for n in ("Stream", "Event", "current_stream", "default_stream",
                                      "set_stream", "stream")})


def stub_memory_stats():  # allocator: statistics stubbed out in the device module
    _module_with(memory_allocated=lambda device=None: 0, max_memory_allocated=lambda device=None: 0)


def oom_as_runtime_error():  # out_of_memory: a failed allocation raised with TORCH_CHECK
    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        count = 1
        for n in size:
            count *= n
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if count * itemsize > (4 << 30):
            raise RuntimeError(f"minidev: malloc of {count * itemsize} bytes failed")
        stride, step = [], 1
        for n in reversed(size):
            stride.insert(0, step)
            step *= max(n, 1)
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    _kernel("empty.memory_format", empty)


def no_is_in_bad_fork():  # generators: torch.manual_seed then never seeds the device
    _module_with(_is_in_bad_fork=None)


def device_index_only():  # serialization: device(...) takes only an int, torch.load passes a device
    _module_with(device=lambda index: torch.accelerator.device_index(int(index)))


def no_set_source_storage():  # storage: set_(storage) without a kernel
    _kernel("set_.source_Storage", _not_implemented("set_.source_Storage"))


def no_module_methods():  # generated_methods: generated for tensors and storages only
    delattr(torch.nn.Module, DEVICE)


def one_device_copies():  # copies: _copy_from handles one device only
    def copy_from(self, dst, non_blocking=False):
        if self.device.type == dst.device.type == DEVICE and self.device != dst.device:
            raise RuntimeError("minidev: copies between devices are not implemented")
        return torch.ops.aten._copy_from_and_resize(self, dst)  # minidev's own copy
    _kernel("_copy_from", copy_from)


def as_strided_through_fallback():  # minimal_ops: as_strided left to the copying fallback
    def as_strided(self, size, stride, storage_offset=None):
        cpu = self.cpu()
        offset = self.storage_offset() if storage_offset is None else storage_offset
        return torch.as_strided(cpu, size, stride, offset).to(self.device)
    _kernel("as_strided", as_strided)


def inexact_exp():  # opinfo_sample: a kernel 0.1% off
    _kernel("exp", lambda x: (torch.exp(x.cpu()) * 1.001).to(x.device))


def no_tanh_backward():  # autograd: a backward operator without a kernel
    _kernel("tanh_backward", _not_implemented("tanh_backward"))


def amp_dtypes_only():  # autocast: the device module lists dtypes, nothing handles the key
    _module_with(get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16])


def autocast_fallthrough_only():  # autocast: every operator passes through, no policy
    amp_dtypes_only()
    library = torch.library.Library("_", "IMPL")
    library.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    _libraries.append(library)


def autocast_lower_only():  # autocast: mm cast down, nothing computed in float32
    autocast_fallthrough_only()

    def mm(a, b):
        low = torch.get_autocast_dtype(DEVICE)
        with torch._C._ExcludeDispatchKeyGuard(
                torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)):
            return torch.mm(a.to(low), b.to(low))
    _kernel("mm", mm, "AutocastPrivateUse1")


def lonely_collectives():  # distributed: a process group whose collectives never communicate
    import torch.distributed as dist
    from torch._C._distributed_c10d import _create_work_from_future
    from torch.futures import Future

    def done(result):
        future = Future()
        future.set_result(result)
        return _create_work_from_future(future)

    class Lonely(dist.ProcessGroup):
        """Every collective returns at once with this rank's own data."""

        def getBackendName(self):
            return "lonely"

        def allreduce(self, tensors, opts=None):
            return done(tensors)

        def broadcast(self, tensors, opts=None):
            return done(tensors)

        def allgather(self, outputs, inputs, opts=None):
            for out, tensor in zip(outputs, inputs):
                for o in out:
                    o.copy_(tensor)
            return done(outputs)

        def send(self, tensors, dst, tag):
            return done(tensors)

        def recv(self, tensors, src, tag):
            return done(tensors)

        def barrier(self, opts=None):
            return done([])

    dist.Backend.register_backend("lonely", lambda store, rank, size, timeout: Lonely(rank, size),
                                  devices=[DEVICE])


def inductor_without_wrapper():  # compile: Dynamo interface and scheduling, no device codegen
    from torch._dynamo import device_interface as di
    from torch._inductor.codegen.common import register_backend_for_device
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    class Interface(di.DeviceInterface):
        device = staticmethod(minidev.device)
        current_device = staticmethod(minidev.current_device)
        set_device = staticmethod(minidev.set_device)
        device_count = staticmethod(minidev.device_count)
        is_available = staticmethod(minidev.is_available)
        synchronize = staticmethod(minidev.synchronize)

    di.register_interface_for_device(DEVICE, Interface)
    register_backend_for_device(DEVICE, CppScheduling, PythonWrapperCodegen)


for _name in filter(None, os.environ.get("MINIDEV_BROKEN", "").split(",")):
    globals()[_name]()
