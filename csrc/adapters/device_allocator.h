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

// Limit of the caching allocator for a device, as a fraction of its capacity.
void set_memory_fraction(double fraction, int device);

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
