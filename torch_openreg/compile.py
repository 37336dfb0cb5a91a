"""torch.compile for openreg: what Dynamo and Inductor need from a device backend.

* Dynamo: a ``DeviceInterface`` for ``openreg`` (devices, streams, events, synchronize, memory,
  properties), registered with ``register_interface_for_device``, and a Dynamo backend named
  ``openreg`` (Inductor, see ``openreg_backend``).
* Inductor: ``register_backend_for_device("openreg", ...)`` with Inductor's CPU C++ scheduling
  (openreg memory is host-addressable: generated C++ kernels read and write device memory in
  place) and a Python wrapper that allocates buffers through the openreg allocator and runs every
  kernel in stream order (``torch_openreg._C._KernelLaunch``, csrc/python/module.cpp); and
  ``register_device_op_overrides("openreg", ...)`` for the device guard, set_device and
  synchronize lines of generated code.

Importing torch._dynamo costs about as much as importing torch itself, so nothing here imports
it: ``install()`` (called by ``import torch_openreg``) arranges for each registration to run
right after the module it extends is imported (``_after_import``), whichever code imports it
first. See docs/compile.md.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from typing import Any, Callable

import torch

__all__ = ["install", "openreg_backend"]


# [docs:start AFTER_IMPORT]
class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hook(module)`` right after ``module`` is executed, the first time it is imported.

    It only wraps the real loader's ``exec_module`` for the modules it watches; the module keeps
    its own spec and loader. A hook must import nothing but the module it is given: it runs in
    the middle of whatever import chain brought that module in.
    """

    def __init__(self) -> None:
        self._hooks: dict[str, Callable[[Any], None]] = {}
        self._lock = threading.Lock()

    def watch(self, name: str, hook: Callable[[Any], None]) -> None:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__spec__", None) is not None:
            hook(module)  # already imported (e.g. with TORCH_DEVICE_BACKEND_AUTOLOAD=0)
            return
        with self._lock:
            self._hooks[name] = hook

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self._hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_hook(module: Any) -> None:
            exec_module(module)
            with self._lock:
                hook = self._hooks.pop(name, None)
            if hook is not None:
                hook(module)

        loader.exec_module = exec_then_hook  # this spec's own loader instance only
        return spec
# [docs:end AFTER_IMPORT]


_after_import = _AfterImport()


# ---- Dynamo ------------------------------------------------------------------------------------

def _exchange_device(device: int) -> int:
    previous = torch.openreg.current_device()
    if device >= 0 and device != previous:
        torch.openreg.set_device(device)
    return previous


def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
    torch.accelerator.set_stream(
        torch.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
    )


def _raw_stream(device: int) -> int:
    """The "raw stream" of generated code: the id of the current stream of ``device``."""
    return torch.openreg.current_stream(device).stream_id


@functools.lru_cache(None)
def _cache_system_info() -> dict[str, object]:
    import hashlib

    from torch_openreg import openreg

    with open(__file__, "rb") as f:
        codegen = hashlib.sha256(f.read()).hexdigest()
    props = openreg.get_device_properties(0)
    return {"openreg_codegen": codegen, "name": props.name,
            "capability": [props.major, props.minor]}


def _register_dynamo(device_interface: Any) -> None:
    from torch_openreg import openreg

    # [docs:start DEVICE_INTERFACE]
    class OpenRegInterface(device_interface.DeviceInterface):
        """What Dynamo and Inductor ask of the device at trace and compile time."""

        device = openreg.device
        Stream = openreg.Stream  # a torch.Stream subclass, as Dynamo requires
        Event = openreg.Event  # makes torch.Event objects of the device

        class Worker:
            """Queries answered in compile workers from values recorded in the main process."""

            @staticmethod
            def set_device(device: int) -> None:
                device_interface.caching_worker_current_devices["openreg"] = device

            @staticmethod
            def current_device() -> int:
                cached = device_interface.caching_worker_current_devices.get("openreg")
                return openreg.current_device() if cached is None else cached

            @staticmethod
            def get_device_properties(device: Any = None) -> Any:
                index = (OpenRegInterface.Worker.current_device() if device is None
                         else openreg._device_index(device))
                cache = device_interface.caching_worker_device_properties
                if "openreg" not in cache:
                    cache["openreg"] = [openreg.get_device_properties(i)
                                        for i in range(openreg.device_count())]
                return cache["openreg"][index]

        current_device = staticmethod(openreg.current_device)
        set_device = staticmethod(openreg.set_device)
        device_count = staticmethod(openreg.device_count)
        is_available = staticmethod(openreg.is_available)
        exchange_device = staticmethod(_exchange_device)
        maybe_exchange_device = staticmethod(_exchange_device)
        stream = staticmethod(openreg.stream)
        current_stream = staticmethod(openreg.current_stream)
        set_stream = staticmethod(openreg.set_stream)
        _set_stream_by_id = staticmethod(_set_stream_by_id)
        get_raw_stream = staticmethod(_raw_stream)
        synchronize = staticmethod(openreg.synchronize)
        get_device_properties = staticmethod(openreg.get_device_properties)
        memory_allocated = staticmethod(openreg.memory_allocated)
        is_bf16_supported = staticmethod(openreg.is_bf16_supported)

        @staticmethod
        def get_compute_capability(device: Any = None) -> int:
            major, minor = openreg.get_device_capability(device)
            return major * 10 + minor

        @staticmethod
        def is_triton_capable(device: Any = None) -> bool:
            return False  # generated code for openreg is C++ (Inductor's CPU codegen)

        # Asked from torch 2.15 on (unused before; docs/torch_releases.md):
        @staticmethod
        def is_gpu() -> bool:
            return False  # not GPU-class: Inductor's CPU (C++) code generation and scheduling

        @classmethod
        def get_cache_system_info(cls) -> dict[str, object]:
            """Part of the key of Inductor's code cache: what the generated code depends on
            beyond torch itself, i.e. this module's code generation and the device's kind."""
            return _cache_system_info()

    device_interface.register_interface_for_device("openreg", OpenRegInterface)
    for i in range(openreg.device_count()):
        device_interface.register_interface_for_device(f"openreg:{i}", OpenRegInterface)
    # [docs:end DEVICE_INTERFACE]


# [docs:start DYNAMO_BACKEND]
def openreg_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """The Dynamo backend ``"openreg"``: Inductor, generating C++ kernels for openreg tensors.

    ``torch.compile(model, backend="openreg")`` is the same as the default backend for graphs
    on openreg tensors; it exists so that code that picks a backend by device name finds one.
    """
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, **kwargs)


def _register_dynamo_backend(registry: Any) -> None:
    registry.register_backend(compiler_fn=openreg_backend, name="openreg")
# [docs:end DYNAMO_BACKEND]


# ---- FakeTensor: the CPU's convolution layouts ---------------------------------------------------

# [docs:start FAKE_CONVOLUTION]
def _fake_convolution_as_on_cpu(fake_impls: Any) -> None:
    """FakeTensor predicts an openreg convolution's layouts as it predicts the CPU's.

    Compilers never run a convolution to learn its layouts: FakeTensor's rule (``conv`` in
    torch/_subclasses/fake_impls.py) asks ATen which backend the convolution would use and that
    backend's memory format. For an openreg tensor ATen answers ``ConvBackend::Overrideable``,
    whose format is NCHW whatever the inputs' layouts (docs/privateuse1_gaps.md), while openreg's
    kernels return the CPU kernel's layouts (channels-last in, channels-last out). So for openreg
    tensors torch's rule runs on CPU fake tensors of the same metadata, and its results come back
    on the openreg device; Inductor's convolution lowering and its layout optimization take their
    layouts from this rule too. Any other device keeps torch's rule untouched. (This file's hash
    is part of Inductor's cache key, ``_cache_system_info``: code compiled under another
    prediction is not reused.)"""
    table = fake_impls.op_implementations_dict
    aten = torch.ops.aten
    for op in (aten.convolution.default, aten._convolution.default,
               aten._convolution.deprecated, aten.convolution_backward.default):
        table[op] = functools.partial(_fake_convolution, table[op])


def _fake_convolution(torch_rule: Callable[..., Any], fake_mode: Any, func: Any, *args: Any,
                      **kwargs: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    fakes = [a for a in (*args, *kwargs.values()) if isinstance(a, FakeTensor)]
    devices = {t.fake_device for t in fakes}
    if len(devices) != 1 or next(iter(devices)).type != "openreg":
        return torch_rule(fake_mode, func, *args, **kwargs)  # and its errors for mixed devices
    device, cpu = devices.pop(), torch.device("cpu")

    def on_cpu(a: Any) -> Any:  # the same tensor, seen as a CPU tensor
        if not isinstance(a, FakeTensor):
            return a
        with in_kernel_invocation_manager(fake_mode):
            return FakeTensor(fake_mode, torch.ops.aten.alias.default(a), cpu)

    def on_device(t: Any) -> Any:  # a fresh result, on the openreg device
        if t is None:
            return t
        with in_kernel_invocation_manager(fake_mode):
            meta = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
            return FakeTensor(fake_mode, meta, device)

    out = torch_rule(fake_mode, func, *map(on_cpu, args),
                     **{k: on_cpu(v) for k, v in kwargs.items()})
    return tuple(map(on_device, out)) if isinstance(out, tuple) else on_device(out)
# [docs:end FAKE_CONVOLUTION]


# ---- Inductor ----------------------------------------------------------------------------------

_INDUCTOR_MODULES = ("torch._inductor.codegen.common", "torch._inductor.codegen.wrapper",
                     "torch._inductor.codegen.cpp")
_inductor_modules: dict[str, Any] = {}

# The share of an openreg kernel's operations that may access memory with a stride other than 0
# or 1 before Inductor writes it without vectors (torch's CPU limit: 0.12). 0.18 takes max pooling
# over NCHW windows (0.15); the CNN's two backward kernels with one strided store in 5 operations
# (0.2) stay scalar, as on the CPU. See OpenRegKernelProxy (STRIDED_LOADS).
_STRIDED_RATIO = 0.18

# The scheduler's loop transformations during fusion that it skips for "cpu" nodes only: the C++
# kernel generator does not support them (loop_reindexing_after_fusion reads a reduction's
# Triton-style (numel, rnumel) group where C++ scheduling groups by loop sizes: "can't multiply
# sequence by non-int of type 'tuple'"; torch's scheduler: "CPU reindexing is not validated yet").
_NO_LOOP_TRANSFORMS = {"loop_ordering_after_fusion": False,
                       "loop_reindexing_after_fusion": False,
                       "loop_index_inversion_in_fusion": False}


def _inductor_module_loaded(module: Any) -> None:
    _inductor_modules[module.__name__] = module
    if len(_inductor_modules) == len(_INDUCTOR_MODULES):
        _register_inductor(*(_inductor_modules[name] for name in _INDUCTOR_MODULES))


def _register_inductor(common: Any, wrapper: Any, cpp: Any) -> None:
    inductor_config = sys.modules["torch._inductor.config"]

    # [docs:start DEVICE_OP_OVERRIDES]
    class OpenRegDeviceOpOverrides(common.DeviceOpOverrides):
        """Lines of Python that generated wrappers use for device management."""

        def import_get_raw_stream_as(self, name: str) -> str:
            return f"from torch_openreg.compile import _raw_stream as {name}"

        def set_device(self, device_idx: int) -> str:
            return f"torch.openreg.set_device({device_idx})"

        def synchronize(self) -> str:
            return "torch.openreg.synchronize()"

        def device_guard(self, device_idx: int) -> str:
            return f"torch.openreg.device({device_idx})"

        def current_stream(self) -> str:
            return "torch.openreg.current_stream()"
    # [docs:end DEVICE_OP_OVERRIDES]

    # [docs:start WRAPPER]
    class _OpenRegWrapperLines:
        """What the Python wrapper of a graph does differently for openreg (mixed into Inductor's
        Python wrapper generators; CPU kernels and buffers of the same graph are left as they
        are)."""

        def write_header(self) -> None:
            super().write_header()
            self.header.splice(
                """
                from torch_openreg._C import _KernelLaunch
                from torch_openreg._C import _empty_strided as empty_strided_openreg
                """,
                strip=True,
            )
            for i in range(torch.openreg.device_count()):
                self.header.writeline(f"openreg_launch_{i} = _KernelLaunch({i})")

        def make_allocation(self, name, device, dtype, shape, stride,
                            allocation_shape=None, is_pinned=False):
            if device.type != "openreg":
                return super().make_allocation(name, device, dtype, shape, stride,
                                               allocation_shape, is_pinned)
            # Through the openreg allocator (csrc/python/module.cpp, EMPTY_STRIDED), on the
            # buffer's own device: the wrapper enters no device guard for devices Inductor does
            # not know as GPUs.
            if allocation_shape is None:
                allocation_shape = shape
            line = (f"{name} = empty_strided_openreg("
                    f"{self.codegen_python_shape_tuple(allocation_shape)}, "
                    f"{self.codegen_python_shape_tuple(stride)}, {dtype}, {device.index or 0})")
            if allocation_shape != shape:
                line += (f".as_strided({self.codegen_python_shape_tuple(shape)}, "
                         f"{self.codegen_python_shape_tuple(stride)})")
            return line

        def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None,
                                         triton=True, **kwargs):
            device = device or wrapper.V.graph.get_current_device_or_throw()
            if device.type != "openreg" or triton:
                return super()._generate_kernel_call_helper(
                    kernel_name, call_args, device=device, triton=triton, **kwargs)
            # In stream order on the current stream of the device, like an eager kernel.
            self.writeline(f"with openreg_launch_{device.index or 0}: "
                           f"{self.wrap_kernel_call(kernel_name, call_args)}")

    class OpenRegSubgraphWrapperCodegen(_OpenRegWrapperLines,
                                        wrapper.SubgraphPythonWrapperCodegen):
        def write_header(self) -> None:
            wrapper.SubgraphPythonWrapperCodegen.write_header(self)  # the parent's serves

    class OpenRegWrapperCodegen(_OpenRegWrapperLines, wrapper.PythonWrapperCodegen):
        @staticmethod
        def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
            if is_subgraph:
                return OpenRegSubgraphWrapperCodegen(subgraph_name, parent_wrapper,
                                                     partition_signatures)
            return OpenRegWrapperCodegen()
    # [docs:end WRAPPER]

    # [docs:start BOOL_VECTORS]
    class OpenRegVecKernel(cpp.CppVecKernel):
        """Inductor's vectorized C++ kernel, with contiguous bool buffers stored and loaded as
        bytes.

        A bool value of a vectorized kernel is a mask, ``at::vec::VecMask<float, N>``.
        ``VecMask::store(bool*)`` converts it lane by lane through ``Vectorized<bool>`` (64
        lanes on AVX-512 for 16 floats: two scalar loops of 64 and stack round trips per 16
        elements) and ``VecMask::from(const bool*)`` builds it lane by lane: a training
        forward that saves relu's mask for the backward spends most of its kernel time there
        (docs/compile.md, "Bool buffers"). Here the mask becomes 0.0/1.0 floats converted to int8
        (one vector conversion, ``at::vec::convert``) and is stored as bytes, and a load widens
        the bytes to int32 and compares them with 0. Same bytes, same masks, on every ISA that
        ``at::vec`` supports.
        """

        def _get_store_line(self, value, var, index, dtype, accu_store=False):
            tiling_var = self.itervars[self.tiling_idx]
            if (dtype != torch.bool or accu_store
                    or self._try_get_const_stride(index, tiling_var) != 1):
                return super()._get_store_line(value, var, index, dtype, accu_store)
            n = self._get_num_vectors(torch.float)
            code = cpp.IndentedBuffer()
            code.writeline(
                f"at::vec::convert<int8_t,1,float,{n}>({value}.template to<float,{n}>())"
                f".store(reinterpret_cast<int8_t*>({var} + {cpp.cexpr_index(index)}), "
                f"{cpp.cexpr_index(self.num_elems)});")
            return code

        def _get_vec_load_line(self, var, index, dtype, load_mask=None):
            if dtype != torch.bool:
                return super()._get_vec_load_line(var, index, dtype, load_mask)
            n = self._get_num_vectors(torch.int32)
            ints = ("at::vec::Vectorized<int32_t>" if n == 1
                    else f"at::vec::VectorizedN<int32_t,{n}>")
            loadbuf = f"{var} + {cpp.cexpr_index(index)}" if index != 0 else var
            nums = (f"at::vec::convert<int32_t,{n},int8_t,1>(at::vec::Vectorized<int8_t>::loadu("
                    f"reinterpret_cast<const int8_t*>({loadbuf}), "
                    f"{cpp.cexpr_index(self.num_elems)}))")
            return (f"at::vec::VecMask<int32_t,{n}>({nums} != {ints}(0))"
                    f".template cast<float,{self._get_num_vectors(torch.float)}>()")

    class OpenRegTile2DKernel(cpp.CppTile2DKernel, OpenRegVecKernel):
        """Inductor's kernel for loops tiled in two dimensions (transposed loads and stores),
        with openreg's vector kernel under it: the same bool bytes, and an instance of the
        proxy's ``vec_kernel_cls``, which ``CppKernelProxy.aggregate_reduction_buffers``
        asserts of the main loop's kernel of a reduction (without this class, training steps
        of ResNet-18, MobileNetV3 and a ViT failed to compile on that assertion)."""

    # [docs:end BOOL_VECTORS]

    # [docs:start STRIDED_LOADS]
    class OpenRegKernelProxy(cpp.CppKernelProxy):
        """Inductor's C++ kernel generation for a group of fused loops, with openreg's vector
        kernels (BOOL_VECTORS) and openreg's limit on strided loads.

        Inductor's CPU heuristic (``TilingSelect.select_tiling``) writes a kernel without
        vectors when at least ``KernelOpStats.OVERHEAD_RATIO_THRESHOLD`` (0.12) of its
        operations access memory with a stride other than 0 or 1. Max pooling with indices
        over NCHW activations reads 2x2 windows with stride 2: 8 such loads in 53 operations
        (0.15), so the kernel, with its index and NaN logic, runs one element at a time. CPU
        graphs rarely meet it: Inductor makes CPU convolution graphs channels-last, where the
        windows are contiguous along channels; openreg's convolution graphs of an NCHW model
        stay NCHW. A vectorized kernel gathers a strided operand with one scalar loop per
        vector, as the scalar kernel reads it anyway, and runs the rest 16 lanes wide: the CNN's
        compiled forward went from 4.9 to 3.3-3.5 ms (docs/compile.md, "Strided loads"). So
        openreg kernels accept up to ``_STRIDED_RATIO`` of such operations. The threshold is a
        class attribute, raised only while this group's kernel is generated. Dynamo compiles
        forward graphs under its compile lock, but AOTAutograd compiles a backward graph at its
        first backward without it (on the device thread for openreg): a CPU graph generated by
        another thread at that moment could see the raised limit (unlike an Inductor
        ``config.patch``, which is thread-local, a class attribute is not). The limit only
        decides whether a kernel is vectorized, never what it computes.
        """

        vec_kernel_cls = OpenRegVecKernel
        tile2d_kernel_cls = OpenRegTile2DKernel

        def codegen_functions(self, fn_list, var_sizes_list):
            with strided_limit:
                return super().codegen_functions(fn_list, var_sizes_list)

    class _StridedLimit:
        """Raises the limit while any thread generates an openreg kernel and puts torch's value
        back when the last one is done (two threads at once never leave it raised)."""

        def __init__(self) -> None:
            self.torch_value = cpp.KernelOpStats.OVERHEAD_RATIO_THRESHOLD
            self.users = 0
            self.lock = threading.Lock()

        def __enter__(self) -> None:
            with self.lock:
                self.users += 1
                cpp.KernelOpStats.OVERHEAD_RATIO_THRESHOLD = max(self.torch_value, _STRIDED_RATIO)

        def __exit__(self, *exc: Any) -> None:
            with self.lock:
                self.users -= 1
                if self.users == 0:
                    cpp.KernelOpStats.OVERHEAD_RATIO_THRESHOLD = self.torch_value

    strided_limit = _StridedLimit()
    # [docs:end STRIDED_LOADS]

    # [docs:start SCHEDULING]
    class OpenRegScheduling(cpp.CppScheduling):
        """Inductor's C++ kernel generation, for openreg buffers.

        Kernel generation asks ``torch._inductor.utils.get_current_backend()`` which language
        it writes; that function knows the device types cpu, mps, xpu and tpu and answers
        ``config.cuda_backend`` ("triton") for any other. While this class generates kernels,
        the answer is made "cpp".

        The scheduler's fusion pass also treats every device but "cpu" as a Triton device: it
        tries three loop transformations (``_NO_LOOP_TRANSFORMS``) that the C++ kernel
        generator does not support, and skips them for nodes on "cpu" only. The scheduler of a
        graph makes this object when it creates the graph's first openreg node, before fusing:
        its fusion pass then runs with the three turned off. Other graphs keep torch's settings.
        """

        kernel_proxy_cls = OpenRegKernelProxy  # BOOL_VECTORS, STRIDED_LOADS

        def __init__(self, scheduler):
            super().__init__(scheduler)
            if scheduler is not None and "fuse_nodes" not in vars(scheduler):
                fuse_nodes = scheduler.fuse_nodes

                def fuse_nodes_without_loop_transforms(nodes):
                    with inductor_config.patch(_NO_LOOP_TRANSFORMS):
                        return fuse_nodes(nodes)

                scheduler.fuse_nodes = fuse_nodes_without_loop_transforms  # this graph's only

        def codegen_node(self, node):
            with inductor_config.patch(cuda_backend="cpp"):
                return super().codegen_node(node)

        def codegen_template(self, *args, **kwargs):
            with inductor_config.patch(cuda_backend="cpp"):
                return super().codegen_template(*args, **kwargs)

        def flush(self):
            with inductor_config.patch(cuda_backend="cpp"):
                return super().flush()
    # [docs:end SCHEDULING]

    # [docs:start CACHE_KEY]
    from torch._inductor.custom_graph_pass import CustomGraphModulePass

    class OpenRegCodegenVersion(CustomGraphModulePass):
        """Inductor caches generated code on disk (FX graph cache) under a key made of the
        graph, torch's version and Inductor's configuration, not of the code generators of a
        device. The uuid of a device's pass is part of the key: this one makes it change with
        this file, so an upgraded torch_openreg never runs wrappers generated by an older one.
        The pass itself leaves the graph as it is."""

        def __call__(self, gm: torch.fx.GraphModule) -> None:
            return None

        def uuid(self) -> str:
            return _source_hash()
    # [docs:end CACHE_KEY]

    # [docs:start REGISTER_BACKEND]
    common.register_backend_for_device("openreg", OpenRegScheduling, OpenRegWrapperCodegen,
                                       device_custom_pass=OpenRegCodegenVersion())
    common.register_device_op_overrides("openreg", OpenRegDeviceOpOverrides())
    # [docs:end REGISTER_BACKEND]


@functools.cache
def _source_hash() -> str:
    import hashlib

    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# [docs:start INSTALL]
def _stream_context_runs_eagerly(decorators: Any) -> None:
    """``with torch.openreg.stream(s):`` inside a compiled function runs as it does in eager mode.

    From torch 2.15 on, Dynamo traces ``torch.accelerator.set_stream`` as a symbolic change of
    stream and drops it from a graph that holds no operator, so the restoring half of the context
    (``__exit__``, graph-broken by the device switch that follows) was lost and the side stream
    stayed current after the call. Both halves are calls Dynamo must not trace: it breaks the
    graph there and runs them as written, as torch 2.13 and 2.14 did by themselves."""
    from torch_openreg.openreg.streams import StreamContext

    for name in ("__enter__", "__exit__"):
        setattr(StreamContext, name, decorators.disable(getattr(StreamContext, name)))


def install() -> None:
    """Called by ``import torch_openreg``: each registration runs when torch imports the module it
    extends (at once if it is already imported)."""
    _after_import.watch("torch._dynamo.device_interface", _register_dynamo)
    _after_import.watch("torch._dynamo.decorators", _stream_context_runs_eagerly)
    _after_import.watch("torch._dynamo.backends.registry", _register_dynamo_backend)
    _after_import.watch("torch._subclasses.fake_impls", _fake_convolution_as_on_cpu)
    for name in _INDUCTOR_MODULES:
        _after_import.watch(name, _inductor_module_loaded)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
# [docs:end INSTALL]
