// Native because: the trace hooks of gpu_trace.h are called from the C++ allocator and runtime.
#include "adapters/gpu_trace.h"

#include <Python.h>

namespace openreg::gpu_trace {

std::atomic<bool> g_enabled{false};

// torch's hook takes the GIL itself; taking it here first (a no-op on the thread that holds it)
// makes this thread's error indicator the one read and restored.
PythonErrorSetAside::PythonErrorSetAside() {
  if (!Py_IsInitialized()) return;
  gil_ = static_cast<int>(PyGILState_Ensure());
  held_ = true;
  PyErr_Fetch(reinterpret_cast<PyObject**>(&error_[0]), reinterpret_cast<PyObject**>(&error_[1]),
              reinterpret_cast<PyObject**>(&error_[2]));
}

PythonErrorSetAside::~PythonErrorSetAside() {
  if (!held_) return;
  // The hook leaves no error of its own (torch logs and clears what the callbacks raise).
  PyErr_Restore(static_cast<PyObject*>(error_[0]), static_cast<PyObject*>(error_[1]),
                static_cast<PyObject*>(error_[2]));
  PyGILState_Release(static_cast<PyGILState_STATE>(gil_));
}

void device_synchronization(int device) {
  if (active() == nullptr) return;
  for (int64_t id = 0; id < kStreamsPerDevice; ++id) stream_synchronization(device, id);
}

}  // namespace openreg::gpu_trace
