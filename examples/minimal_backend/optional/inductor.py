"""Optional mechanism of minidev: torch.compile with its default backend, Inductor
(docs/compile.md).

minidev/__init__.py imports this file from optional/ as ``minidev.inductor`` when it is there.
Without it, torch.compile of a function on minidev tensors fails and the core still passes every
required check. Python: Dynamo and Inductor take their device registrations only from Python.
"""
# [docs:start INDUCTOR]
import os
import types

from torch._dynamo import device_interface
from torch._inductor.codegen.common import (DeviceOpOverrides, register_backend_for_device,
                                             register_device_op_overrides)
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.wrapper import PythonWrapperCodegen
from torch._inductor.virtualized import V

import minidev

DEVICE = "minidev"


def _exchange_device(device: int) -> int:
    previous = minidev.current_device()
    if device >= 0:
        minidev.set_device(device)
    return previous


def get_raw_stream(device: int) -> int:  # generated code's "raw stream": the stream's id
    return minidev.current_stream(device).stream_id


class MinidevInterface(device_interface.DeviceInterface):
    """What Dynamo and Inductor ask of the device while they trace and compile."""

    device = staticmethod(minidev.device)
    Stream, Event = minidev.Stream, minidev.Event
    current_device = staticmethod(minidev.current_device)
    set_device = staticmethod(minidev.set_device)
    device_count = staticmethod(minidev.device_count)
    is_available = staticmethod(minidev.is_available)
    synchronize = staticmethod(minidev.synchronize)
    current_stream = staticmethod(minidev.current_stream)
    set_stream = staticmethod(minidev.set_stream)
    exchange_device = maybe_exchange_device = staticmethod(_exchange_device)

    get_raw_stream = staticmethod(get_raw_stream)

    @staticmethod
    def get_device_properties(device=None):  # Inductor's reduction heuristics read these
        return types.SimpleNamespace(name="minidev", multi_processor_count=os.cpu_count() or 1)

    @staticmethod
    def get_compute_capability(device=None) -> int:
        return 0  # part of Inductor's cache keys: no device generations here

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def is_triton_capable(device=None) -> bool:
        return False  # kernels are Inductor's C++ CPU kernels

    @staticmethod
    def is_gpu() -> bool:
        return False


class MinidevOpOverrides(DeviceOpOverrides):
    """The device lines Inductor writes into generated wrappers."""

    def import_get_raw_stream_as(self, name: str) -> str:
        return f"from minidev.inductor import get_raw_stream as {name}"

    def set_device(self, device_idx: int) -> str:
        return f"torch.minidev.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.minidev.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.minidev.device({device_idx})"


class MinidevWrapperCodegen(PythonWrapperCodegen):
    """The Python wrapper of a compiled graph: buffers come from torch.empty_strided on the device
    (Inductor's default for a device it does not know), and a kernel is called like a CPU kernel,
    on the device memory's host addresses (minidev's device memory is host memory; a real device
    launches its kernel here, on the current stream)."""

    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        if is_subgraph:
            return PythonWrapperCodegen.create(is_subgraph, subgraph_name, parent_wrapper,
                                               partition_signatures)
        return MinidevWrapperCodegen()

    def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, triton=True,
                                     **kwargs):
        device = device or V.graph.get_current_device_or_throw()
        if device.type == DEVICE and not triton:
            self.writeline(self.wrap_kernel_call(kernel_name, call_args))
            return
        super()._generate_kernel_call_helper(kernel_name, call_args, device=device,
                                             triton=triton, **kwargs)


device_interface.register_interface_for_device(DEVICE, MinidevInterface)
for _index in range(minidev.device_count()):
    device_interface.register_interface_for_device(f"{DEVICE}:{_index}", MinidevInterface)
# Inductor's C++ (CPU) code generation schedules and writes the kernels; the wrapper calls them.
register_backend_for_device(DEVICE, CppScheduling, MinidevWrapperCodegen)
register_device_op_overrides(DEVICE, MinidevOpOverrides())
# [docs:end INDUCTOR]
