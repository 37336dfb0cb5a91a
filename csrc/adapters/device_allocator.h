// Native because: PyTorch only accepts a device allocator as a C++ c10::DeviceAllocator.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Stream.h>

namespace openreg {

// The caching allocator of openreg device memory (registered for PrivateUse1).
c10::DeviceAllocator* device_allocator();

// Allocator bound to one device: the allocator of every openreg storage, so that resizing a
// storage allocates on the storage's device whatever the current device is.
c10::Allocator* allocator_for_device(int device);

// Allocates on an explicit device (the Allocator interface uses the current device).
c10::DataPtr allocate_on_device(int device, size_t nbytes);

// True when the DataPtr's memory came from the device allocator (whatever device the
// DataPtr claims): such memory can be adopted by a device storage without a copy.
bool is_device_memory(const c10::DataPtr& ptr);

// [docs:start PRIVATE_POOLS]
// Private memory pools of graphs (adapters/graph.cpp). While a stream captures a graph, the
// allocations made on it come from the graph's pool: blocks of a pool are only ever handed out
// again to allocations of the same pool (the graph replays into them), never to other work, and
// empty_cache keeps them. When the last graph using a pool releases it, its free memory goes
// back to the driver and blocks still held by tensors follow when those are freed.
int64_t pool_acquire(int device, c10::MempoolId_t id);  // returns the pool's allocator key
void pool_release(int device, c10::MempoolId_t id);
// True when `ptr` is the start of a live block of a private pool.
bool in_private_pool(int device, const void* ptr);
// [docs:end PRIVATE_POOLS]

// Limit of the caching allocator for a device, as a fraction of its capacity.
void set_memory_fraction(double fraction, int device);
// For the sanitizer: the device, stream (pool key) and requested size of a live device block.
bool device_block_info(const void* ptr, int* device, int64_t* stream, size_t* size);

// While alive on a thread, CPU allocations made by that thread come from the device
// allocator of `device`. The generic fallback runs CPU kernels under it, so that the
// tensors a kernel creates (its outputs and workspaces) live in device memory.
class AllocateOnDevice {
 public:
  explicit AllocateOnDevice(int device);
  ~AllocateOnDevice();
  AllocateOnDevice(const AllocateOnDevice&) = delete;
  AllocateOnDevice& operator=(const AllocateOnDevice&) = delete;

 private:
  int previous_;
};

}  // namespace openreg
