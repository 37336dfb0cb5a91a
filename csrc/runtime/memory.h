// Native because: the simulated device driver owns device memory (the role of cudaMalloc/cudaFree);
// the caching allocator and every kernel launch call it from C++.
#pragma once

#include <cstddef>
#include <cstdint>

namespace openreg {

// Driver-level allocation of a whole segment of device memory on `device`.
// Returns nullptr when the device's capacity (OPENREG_DEVICE_MEMORY) would be exceeded,
// like cudaMalloc returning cudaErrorMemoryAllocation. Never called per operator:
// the caching allocator (csrc/adapters/device_allocator.cpp) sits in between.
// Each segment is backed by its own shared-memory file (memfd), so that another process can map
// it (IPC, csrc/adapters/ipc.cpp); its pages are freed when no process maps it any more.
void* segment_alloc(int device, size_t size);
// Frees a segment of this process, or unmaps a segment imported from another process.
void segment_free(void* ptr);

// ---- shareable segments (IPC: csrc/adapters/ipc.cpp)
struct SegmentInfo {
  char* base = nullptr;
  size_t size = 0;
  int device = -1;
  int fd = -1;  // the segment's shared-memory file, -1 when it has none (not shareable)
};
// The live segment containing `ptr` (anywhere inside it); false for host memory.
bool find_segment(const void* ptr, SegmentInfo& info);
// Maps `size` bytes of a segment file of another process as device memory of `device` in this
// process (strict memory mode applies to it as to local segments). Takes ownership of `fd`.
// Not counted in this process's usage: the memory belongs to the process that allocated it.
// Returns nullptr (and closes fd) when mmap fails. Released with segment_free.
void* segment_import(int device, int fd, size_t size);

// Bytes held in segments on `device` (what the driver would report as used).
size_t driver_used(int device);

// Device owning the address (anywhere inside a live segment), or -1 for host memory.
int device_of_pointer(const void* ptr);

// Memory isolation. In strict mode (OPENREG_STRICT_MEMORY=1) device pages are PROT_NONE to
// the host except while a KernelScope is alive (a kernel or a copy run by the runtime), so a
// host access through a raw device pointer faults with a message naming the device.
bool strict_memory() noexcept;

class KernelScope {
 public:
  KernelScope() {
    if (strict_memory()) enter();
  }
  ~KernelScope() {
    if (strict_memory()) leave();
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  static void enter();
  static void leave();
};

}  // namespace openreg
