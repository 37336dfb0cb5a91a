// Native because: the trace hooks of gpu_trace.h are called from the C++ allocator and runtime.
#include "adapters/gpu_trace.h"

#include <Python.h>

namespace openreg::gpu_trace {

std::atomic<bool> g_enabled{false};

KeepPythonError::KeepPythonError() {
  if (!Py_IsInitialized() || !PyGILState_Check() || PyErr_Occurred() == nullptr) return;
  PyErr_Fetch(reinterpret_cast<PyObject**>(&saved[0]), reinterpret_cast<PyObject**>(&saved[1]),
              reinterpret_cast<PyObject**>(&saved[2]));
}
KeepPythonError::~KeepPythonError() {
  if (saved[0] == nullptr) return;
  PyErr_Restore(static_cast<PyObject*>(saved[0]), static_cast<PyObject*>(saved[1]),
                static_cast<PyObject*>(saved[2]));
}

void device_synchronization(int device) {
  if (active() == nullptr) return;
  for (int64_t id = 0; id < kStreamsPerDevice; ++id) stream_synchronization(device, id);
}

}  // namespace openreg::gpu_trace
