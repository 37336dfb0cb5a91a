// Native because: the allocator, events and synchronizations report to a stream sanitizer through
// c10::impl::GPUTrace, which only C++ can call (torch_openreg/sanitizer.py, docs/sanitizer.md).
//
// PyTorch's trace hooks: while a sanitizer is on, the runtime tells torch which device memory is
// allocated and freed, which events are recorded and waited for on which stream, and when the
// host synchronizes. torch routes each call (PyInterpreter, device type PrivateUse1) to the
// callback registries of `torch.openreg._gpu_trace` (torch_openreg/openreg/_gpu_trace.py), as it
// routes CUDA's to torch.cuda._gpu_trace. When the sanitizer is off, each hook is one relaxed
// atomic load.
#pragma once

#include "runtime/stream.h"

#include <c10/core/impl/GPUTrace.h>

#include <atomic>
#include <cstdint>

namespace openreg::gpu_trace {

// Set by torch_openreg.sanitizer.enable()/disable() (_C._set_gpu_trace).
extern std::atomic<bool> g_enabled;

// [docs:start GPU_TRACE_PENDING_ERROR]
// Sets aside, while a hook runs, the Python exception this thread is raising, if any, and puts it
// back after. CPython frees the temporaries of a frame that an exception leaves while that
// exception is still set: in `f(t(), y.expand(bad_shape))`, the tensor t() returned reaches
// delete_device_memory with expand's exception pending. torch's hook imports torch.openreg._gpu_trace
// and calls Python, which must not start with one: the import raised SystemError, torch logged
// and dropped it, and the exception being raised went with it; the interpreter then handled an
// exception that was no longer there (a segmentation fault, or SystemError in place of the
// operator's RuntimeError). CPython does the same around a __del__ method.
class PythonErrorSetAside {
 public:
  PythonErrorSetAside();
  ~PythonErrorSetAside();
  PythonErrorSetAside(const PythonErrorSetAside&) = delete;
  PythonErrorSetAside& operator=(const PythonErrorSetAside&) = delete;

 private:
  bool held_ = false;
  int gil_ = 0;  // PyGILState_STATE
  void* error_[3] = {nullptr, nullptr, nullptr};  // type, value, traceback
};
// [docs:end GPU_TRACE_PENDING_ERROR]

// [docs:start GPU_TRACE_HOOKS]
inline const c10::impl::PyInterpreter* active() {
  if (!g_enabled.load(std::memory_order_relaxed)) return nullptr;
  // Stream workers never call into Python: the host may hold the GIL while it waits for them.
  if (on_stream_worker()) return nullptr;
  return c10::impl::GPUTrace::get_trace();
}

// A stream crosses the hook as one integer: device << 16 | stream id.
inline uintptr_t stream_handle(int device, int64_t id) {
  return (uintptr_t(device) << 16) | uintptr_t(id);
}

constexpr auto kType = c10::DeviceType::PrivateUse1;

// Each hook: nothing while the sanitizer is off; else torch's hook, any pending Python error set
// aside (a tensor or an event freed while an exception propagates).
inline void memory_allocation(const void* ptr) {
  if (auto* t = active()) {
    PythonErrorSetAside aside;
    (*t)->trace_gpu_memory_allocation(kType, uintptr_t(ptr));
  }
}
inline void memory_deallocation(const void* ptr) {
  if (auto* t = active()) {
    PythonErrorSetAside aside;
    (*t)->trace_gpu_memory_deallocation(kType, uintptr_t(ptr));
  }
}
inline void event_record(const void* event, int device, int64_t stream) {
  if (auto* t = active()) {
    PythonErrorSetAside aside;
    (*t)->trace_gpu_event_record(kType, uintptr_t(event), stream_handle(device, stream));
  }
}
inline void event_wait(const void* event, int device, int64_t stream) {
  if (auto* t = active()) {
    PythonErrorSetAside aside;
    (*t)->trace_gpu_event_wait(kType, uintptr_t(event), stream_handle(device, stream));
  }
}
inline void event_synchronization(const void* event) {
  if (auto* t = active()) {
    PythonErrorSetAside aside;
    (*t)->trace_gpu_event_synchronization(kType, uintptr_t(event));
  }
}
inline void event_deletion(const void* event) {
  if (auto* t = active()) {
    PythonErrorSetAside aside;
    (*t)->trace_gpu_event_deletion(kType, uintptr_t(event));
  }
}
inline void stream_synchronization(int device, int64_t stream) {
  if (auto* t = active()) {
    PythonErrorSetAside aside;
    (*t)->trace_gpu_stream_synchronization(kType, stream_handle(device, stream));
  }
}
// The host waited for every stream of `device` (torch's device hook carries no device index).
void device_synchronization(int device);
// [docs:end GPU_TRACE_HOOKS]

}  // namespace openreg::gpu_trace
