// Native because: PyTorch only accepts the pinned (host) memory allocator as a C++
// at::HostAllocator, returned by the PrivateUse1 hooks.
#pragma once

#include <ATen/core/CachingHostAllocator.h>

namespace openreg {

// Allocator of pinned host memory for openreg (tensor.pin_memory(), DataLoader(pin_memory=True)).
at::HostAllocator* host_allocator();

// True for any address inside a live pinned allocation.
bool is_pinned_pointer(const void* ptr);

}  // namespace openreg
