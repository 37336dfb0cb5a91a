// Native because: this is the per-operator hot path of the generic fallback (~3 us per op in
// C++ against ~13 us in Python, see ../shared/DESIGN.md).
//
// How an openreg operator runs a CPU kernel on device memory, zero-copy:
//   HostKernel k(device);              // stream order, host access to device pages, and
//                                      // CPU allocations redirected to the device allocator
//   at::Tensor x = k.alias(dev_x);     // CPU tensor over the same memory (no copy)
//   at::Tensor y = at::relu(x);        // any CPU kernel; y is allocated in device memory
//   return k.result(y);                // device tensor: the original argument, a view of an
//                                      // argument's storage, or y's memory adopted as is
#pragma once

#include "adapters/autograd.h"
#include "adapters/device_allocator.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

namespace openreg {

// Called before a thread's kernels (does its work once per thread): OpenMP threads of kernels on
// the autograd worker threads and the stream workers (cpu_kernel.cpp, KERNEL_THREADS).
void configure_kernel_thread();

// The OpenMP thread count the calling thread's kernels run with (configures the thread first).
// A kernel that runs on another thread than the one that issued it (a stream's worker in the
// asynchronous mode, a graph's replay) takes the issuing thread's count with it: the count is
// part of a kernel's result (docs/determinism.md).
int kernel_thread_count();
// On a thread that runs kernels issued by other threads (a stream's worker): its next kernels run
// with `threads` OpenMP threads. Cheap when the count does not change.
void use_kernel_thread_count(int threads);
// The same for a scope: the previous count comes back at its end (a graph replay on the caller).
class KernelThreadCount {
 public:
  explicit KernelThreadCount(int threads);
  ~KernelThreadCount();
  KernelThreadCount(const KernelThreadCount&) = delete;
  KernelThreadCount& operator=(const KernelThreadCount&) = delete;

 private:
  int previous_ = 0;  // 0: unchanged
};

class HostKernel {
 public:
  explicit HostKernel(int device, int memo_site = -1)
      : device_(device), launch_(current_stream(device)), allocate_(device),
        s_(acquire_session(memo_site, memo_)) {}
  ~HostKernel();
  HostKernel(const HostKernel&) = delete;
  HostKernel& operator=(const HostKernel&) = delete;

  int device() const { return device_; }

  // CPU tensor aliasing the device tensor's memory, sizes, strides and offset. Tensors that share
  // a storage get aliases that share a storage, so CPU kernels see the same overlaps.
  at::Tensor alias(const at::Tensor& device_tensor) { return alias_ref(device_tensor); }
  // The same, without a reference count: the alias the session holds for the call. The reference
  // is valid until the next alias call (the session's list may grow), so take what it needs from
  // it at once (routes/unboxed.cpp borrows the tensor, which the session keeps alive).
  const at::Tensor& alias_ref(const at::Tensor& device_tensor);

  // Before the first alias: the caller holds every device tensor it passes to alias() until this
  // HostKernel ends (an unboxed kernel's arguments), so the session borrows them instead of
  // taking a reference count per tensor. (The boxed fallback cannot: it replaces the stack's
  // references by the aliases.)
  void caller_holds_arguments();

  // After the kernel: if it resized or restrided the alias of `device_tensor` (an argument
  // written in place or an out= argument), carry the change over to the device tensor.
  void sync_written(const at::Tensor& device_tensor);
  // The same, given the alias alias() returned for it (no lookup).
  void sync_written(const at::Tensor& device_tensor, const at::Tensor& cpu);

  // The device tensor for a tensor the kernel returned. Given with std::move (the caller keeps no
  // other reference), a fresh result in device memory becomes the device tensor in place.
  at::Tensor result(const at::Tensor& cpu_tensor);
  at::Tensor result(at::Tensor&& cpu_tensor);

  // What a session remembers (the tensors it aliased or returned and their storages) and how it
  // finds them again: pooled per thread and nesting level, so that their memory is reused from
  // call to call (cpu_kernel.cpp).
  struct Session;
  // Aliases kept from call to call, per thread and device tensor (cpu_kernel.cpp, ALIAS_CACHE).
  struct AliasCache;
  // A call site's memo of the tensors its last call aliased, per thread (cpu_kernel.cpp,
  // ALIAS_MEMO): a call that passes the same tensors again (an optimizer step's lists) finds their
  // cached aliases without a lookup. A site gets its number once (new_memo_site) and passes it to
  // each HostKernel.
  struct AliasMemo;
  static int new_memo_site();

 private:
  static Session* acquire_session(int memo_site, AliasMemo*& memo);
  const at::Tensor& alias_ordinary(const at::Tensor& device_tensor);  // not from the memo
  c10::Storage device_storage_for(const at::Tensor& cpu_tensor);

  const int device_;
  DeviceThreadPlacement placement_;  // device threads follow the caller's core (autograd.cpp)
  LaunchScope launch_;
  KernelScope kernel_;
  AllocateOnDevice allocate_;
  AliasMemo* memo_ = nullptr;  // set by acquire_session, before s_
  Session* const s_;
};

// A tensor of dispatch key `key` over `storage` with the metadata of `like` (sizes, strides,
// offset, dtype, conjugate and negative bits).
at::Tensor make_tensor_like(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like);

// A device tensor over `storage` with the metadata of `like` (sizes, strides, offset, dtype).
at::Tensor make_device_tensor(c10::Storage storage, const at::Tensor& like);

// A CPU tensor over device memory for a short host-side access (no session, no dedup).
at::Tensor cpu_alias(const at::Tensor& device_tensor);

}  // namespace openreg
