// Native because: a kernel registered with TORCH_LIBRARY_IMPL is C++ (that is the route this file
// shows), and it is on the per-operator hot path.
//
// Route: a hand-written kernel for an aten operator. `TORCH_LIBRARY_IMPL(aten, PrivateUse1, m)`
// puts the backend's own function in the operator's PrivateUse1 slot; the dispatcher calls it
// unboxed, with typed C++ arguments, instead of the generic fallback. A backend does this for the
// operators it can run better than "the CPU kernel on device memory".
//
// openreg does it for `mse_loss`: the CPU computes (a - b)^2 into a full-size temporary, then
// reduces it (two passes over memory and an allocation of the input's size); this kernel reduces
// in one pass, accumulating in double. Cases it does not fuse go to the CPU kernel on device memory.
#include "adapters/graph.h"
#include "ops/cpu_kernel.h"
#include "routes/call_counter.h"
#include "runtime/device.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Reduction.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <functional>

namespace openreg {
namespace {

int same_device(const char* op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device() == b.device(), "Expected all tensors to be on the same device, but found "
              "at least two devices, ", a.device(), " and ", b.device(), "! (in ", op, ")");
  check_device(a.device().index());
  return a.device().index();
}

// sum((a[i] - b[i])^2) in one pass, split across threads for large inputs.
template <typename T>
double sum_squared_difference(const T* a, const T* b, int64_t n) {
  return at::parallel_reduce(
      0, n, at::internal::GRAIN_SIZE, 0.0,
      [&](int64_t begin, int64_t end, double acc) {
#pragma omp simd reduction(+ : acc)
        for (int64_t i = begin; i < end; ++i) {
          const double d = double(a[i]) - double(b[i]);
          acc += d * d;
        }
        return acc;
      },
      std::plus<double>());
}

std::atomic<int64_t>& calls = call_counter("aten_kernel.mse_loss");
std::atomic<int64_t>& fused_calls = call_counter("aten_kernel.mse_loss.fused");

// [docs:start MSE_LOSS]
at::Tensor mse_loss(const at::Tensor& self, const at::Tensor& target, int64_t reduction) {
  calls.fetch_add(1, std::memory_order_relaxed);
  const int device = same_device("aten::mse_loss", self, target);
  if (Capture* c = capturing(device))  // graph capture: recorded, not run (adapters/graph.h)
    return capture_call<at::Tensor>(c, device, "aten::mse_loss", "", self, target, reduction);
  HostKernel k(device);  // stream order, device memory
  at::Tensor a = k.alias(self), b = k.alias(target);           // CPU views of the same memory
  const auto dtype = a.scalar_type();
  const bool fusable = reduction != at::Reduction::None && a.sizes() == b.sizes() &&
                       dtype == b.scalar_type() && (dtype == at::kFloat || dtype == at::kDouble) &&
                       a.is_contiguous() && b.is_contiguous() && !a.is_neg() && !b.is_neg();
  if (!fusable) return k.result(at::mse_loss(a, b, reduction));  // the CPU kernel, as the fallback
  fused_calls.fetch_add(1, std::memory_order_relaxed);
  at::Tensor loss = at::empty({}, a.options());  // allocated on the device (HostKernel)
  AT_DISPATCH_FLOATING_TYPES(dtype, "mse_loss", [&] {
    double sum = sum_squared_difference(a.const_data_ptr<scalar_t>(),
                                        b.const_data_ptr<scalar_t>(), a.numel());
    // Mean of no elements is NaN, as on the CPU.
    if (reduction == at::Reduction::Mean) sum /= static_cast<double>(a.numel());
    *loss.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(sum);
  });
  return k.result(loss);
}
// [docs:end MSE_LOSS]

}  // namespace

// [docs:start REGISTRATION]
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("mse_loss", TORCH_FN(mse_loss));
}
// [docs:end REGISTRATION]

}  // namespace openreg
