"""``torch.openreg._gpu_trace``: where torch delivers the runtime's trace hooks.

While ``torch._C._activate_gpu_trace()`` is on, torch calls, for each hook the openreg runtime
fires (csrc/adapters/gpu_trace.h, device type PrivateUse1), ``fire_callbacks`` of the registry of
the same name in ``torch.<backend>._gpu_trace``, the way CUDA's go to ``torch.cuda._gpu_trace``.
The stream sanitizer (torch_openreg/sanitizer.py) registers its callbacks here.

Arguments: memory hooks get the block's address; event hooks the event handle (and the stream);
a stream is one integer, ``device << 16 | stream_id``.
"""

from __future__ import annotations

from torch._utils import CallbackRegistry

# [docs:start GPU_TRACE_REGISTRIES]
EventCreationCallbacks: CallbackRegistry = CallbackRegistry("openreg event creation")
EventDeletionCallbacks: CallbackRegistry = CallbackRegistry("openreg event deletion")
EventRecordCallbacks: CallbackRegistry = CallbackRegistry("openreg event record")
EventWaitCallbacks: CallbackRegistry = CallbackRegistry("openreg event wait")
MemoryAllocationCallbacks: CallbackRegistry = CallbackRegistry("openreg memory allocation")
MemoryDeallocationCallbacks: CallbackRegistry = CallbackRegistry("openreg memory deallocation")
StreamCreationCallbacks: CallbackRegistry = CallbackRegistry("openreg stream creation")
DeviceSynchronizationCallbacks: CallbackRegistry = CallbackRegistry("openreg device synchronization")
StreamSynchronizationCallbacks: CallbackRegistry = CallbackRegistry("openreg stream synchronization")
EventSynchronizationCallbacks: CallbackRegistry = CallbackRegistry("openreg event synchronization")
# [docs:end GPU_TRACE_REGISTRIES]

ALL = (
    EventCreationCallbacks, EventDeletionCallbacks, EventRecordCallbacks, EventWaitCallbacks,
    MemoryAllocationCallbacks, MemoryDeallocationCallbacks, StreamCreationCallbacks,
    DeviceSynchronizationCallbacks, StreamSynchronizationCallbacks, EventSynchronizationCallbacks,
)
