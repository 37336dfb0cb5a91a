// Native because: PyTorch only accepts the pinned (host) memory allocator as a C++
// at::HostAllocator, returned by the PrivateUse1 hooks.
#pragma once

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

namespace openreg {

// Caching allocator of pinned host memory for openreg (tensor.pin_memory(),
// torch.empty(..., pin_memory=True), DataLoader(pin_memory=True)), built on PyTorch's
// at::CachingHostAllocatorImpl like CUDA's: freed blocks are cached and reused, and a block
// used by queued stream work (record_event) is only reused once that work has run.
at::HostAllocator* host_allocator();

// True for any address inside a pinned block (in use or cached).
bool is_pinned_pointer(const void* ptr);

// Marks the pinned storage of `host` as used by the work queued so far on `stream`: when the
// tensor is freed, its block is not handed out again before that work has run. Returns false if
// the memory is not a block of the pinned allocator.
bool record_host_use(const at::Tensor& host, c10::Stream stream);

}  // namespace openreg
