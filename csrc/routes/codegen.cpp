// Native because: the kernels torchgen's generated registration calls are C++ functions with the
// declarations it generated (build/<torch build tag>/generated/PrivateUse1NativeFunctions.h).
//
// Route: torchgen external-backend codegen. csrc/routes/codegen.yaml lists operators; at build
// time torchgen.gen_backend_stubs turns it into a header of kernel declarations (a struct of
// static functions, one per operator, with the C++ signature ATen uses) and a registration file
// (wrappers + TORCH_LIBRARY_IMPL). This file defines the kernels; the build fails if one is
// missing. This is how backends with hundreds of kernels keep signatures in sync with PyTorch.
//
// openreg uses it for filling memory (torch.zeros, torch.full, zero_grad, optimizer states):
// fill_ runs the CPU fill kernel on device memory, zero_ of a dense tensor is a memset.
#include "adapters/graph.h"
#include "generated/PrivateUse1NativeFunctions.h"

#include "ops/async_kernel.h"
#include "ops/cow.h"
#include "ops/cpu_kernel.h"
#include "routes/call_counter.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/ops/copy.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/fill.h>
#include <ATen/TensorIterator.h>

#include <algorithm>
#include <cstring>

namespace openreg::codegen {
namespace {

std::atomic<int64_t>& fill_calls = call_counter("codegen.fill_");
std::atomic<int64_t>& zero_calls = call_counter("codegen.zero_");

// Dense: the elements occupy exactly numel() consecutive slots from data_ptr() (any dense
// permutation of dimensions), so filling is a plain loop over memory. Conjugate or negative views
// store transformed values: the CPU kernel on device memory handles those and strided views.
bool fills_directly(const at::Tensor& self) {
  return self.is_non_overlapping_and_dense() && !self.is_conj() && !self.is_neg() &&
         !at::isQIntType(self.scalar_type()) && !at::isBitsType(self.scalar_type());
}

at::Tensor& fill_on_cpu_kernel(at::Tensor& self, const at::Scalar& value) {
  HostKernel k(self.device().index());
  materialize_written(self);  // copy-on-write (ops/cow.h)
  k.alias(self).fill_(value);
  return self;
}

}  // namespace

// [docs:start KERNELS]
at::Tensor& PrivateUse1NativeFunctions::fill_(at::Tensor& self, const at::Scalar& value) {
  fill_calls.fetch_add(1, std::memory_order_relaxed);
  if (Capture* c = capturing(self.device().index())) {  // graph capture: recorded, not run
    capture_call<at::Tensor>(c, self.device().index(), "aten::fill_", "Scalar", self, value);
    return self;
  }
  // Asynchronous kernel mode (ops/async_kernel.h): queued on the stream like a kernel.
  if (async_kernels_enabled() && async_fill(self, value)) return self;
  // The CPU's fill kernel on the device memory: vectorized and parallel. (A plain std::fill loop
  // here measured 7x slower on a 4 MB tensor: 423 us against 59 us.)
  return fill_on_cpu_kernel(self, value);
}

at::Tensor& PrivateUse1NativeFunctions::fill_(at::Tensor& self, const at::Tensor& value) {
  TORCH_CHECK(value.dim() == 0, "fill_ only supports 0-dimension value tensor but got tensor with ",
              value.dim(), " dimensions.");
  // As the CPU's fill_(Tensor) (found by tools/fuzz.py): an expanded destination is refused,
  // although fill_(Scalar) accepts it.
  at::assert_no_internal_overlap(self);
  if (value.is_cpu()) return fill_(self, value.item());
  return self.copy_(value);  // a device value: broadcast on the device, no wait for the host
}

at::Tensor& PrivateUse1NativeFunctions::zero_(at::Tensor& self) {
  zero_calls.fetch_add(1, std::memory_order_relaxed);
  if (Capture* c = capturing(self.device().index())) {  // graph capture: recorded, not run
    capture_call<at::Tensor>(c, self.device().index(), "aten::zero_", "", self);
    return self;
  }
  if (async_kernels_enabled() && async_fill(self, 0, fills_directly(self)))  // ops/async_kernel.h
    return self;
  if (!fills_directly(self)) return fill_(self, 0);
  if (self.numel() == 0) return self;
  LaunchScope launch(current_stream(self.device().index()));
  mark_launch_as(ActivityKind::Memset, size_t(self.numel()) * self.element_size());
  KernelScope on_device;
  std::memset(self.mutable_data_ptr(), 0, self.numel() * self.element_size());  // 0 in every dtype
  return self;
}
// [docs:end KERNELS]

}  // namespace openreg::codegen
