// Native because: the trace hooks of gpu_trace.h are called from the C++ allocator and runtime.
#include "adapters/gpu_trace.h"

namespace openreg::gpu_trace {

std::atomic<bool> g_enabled{false};

void device_synchronization(int device) {
  if (active() == nullptr) return;
  for (int64_t id = 0; id < kStreamsPerDevice; ++id) stream_synchronization(device, id);
}

}  // namespace openreg::gpu_trace
