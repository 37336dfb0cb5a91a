// Native because: a DispatchStub only accepts a C++ function pointer
// (REGISTER_PRIVATEUSE1_DISPATCH), and the kernel is the per-element loop itself.
//
// Route: DispatchStub. Many ATen operators are written once for every device: the device-generic
// part (type promotion, broadcasting, allocating or resizing `out`, building a TensorIterator)
// lives in at::native, and only the inner loop is looked up per device type in a DispatchStub.
// A backend that registers its loop for a stub gets the whole operator family that uses the stub,
// with PyTorch's own argument handling.
//
// openreg does it for `abs`:
//   abs(x), x.abs_()     CompositeExplicitAutograd in ATen: they call abs.out
//   abs.out(x, out=y)    registered below as ATen's own device-generic at::native::abs_out,
//                        which builds the TensorIterator (resizing `out`, computing complex inputs
//                        through a complex temporary) and calls abs_stub(PrivateUse1, iter)
//   abs_stub             abs_kernel below: the loop over device memory, for every dtype the
//                        CPU's abs accepts (integers included).
#include "adapters/graph.h"
#include "routes/call_counter.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/TensorIterator.h>
#include <ATen/native/UnaryOps.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/abs_native.h>
#include <c10/util/complex.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

namespace openreg {
namespace {

// |v| per dtype, with the CPU's results: integers wrap (abs(-128) of int8 is -128), -0.0 becomes
// 0.0, NaN stays NaN, and a complex number gets its modulus as real part.
template <typename T>
T abs_value(T v) {
  if constexpr (std::is_same_v<T, uint8_t>) {
    return v;
  } else if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return v < 0 ? static_cast<T>(U(0) - static_cast<U>(v)) : v;  // no signed overflow
  } else if constexpr (c10::is_complex<T>::value) {
    using R = decltype(v.real());
    using Op = std::conditional_t<std::is_same_v<R, c10::Half>, float, R>;
    c10::complex<Op> z(static_cast<Op>(v.real()), static_cast<Op>(v.imag()));
    return T(static_cast<R>(std::abs(z)), R(0));
  } else if constexpr (std::is_same_v<T, double>) {
    return std::fabs(v);
  } else {  // float, Half, BFloat16, the float8 types: through float
    return static_cast<T>(std::fabs(static_cast<float>(v)));
  }
}

std::atomic<int64_t>& calls = call_counter("abs_stub");

// [docs:start ABS_KERNEL]
// The loop PyTorch looks up in abs_stub for openreg tensors. `iter` has already checked, promoted,
// broadcast and allocated or resized the output; it hands out (output, input) pointers and byte
// strides, contiguous or not.
void abs_kernel(at::TensorIteratorBase& iter) {
  calls.fetch_add(1, std::memory_order_relaxed);
  if (Capture* c = capturing(iter.device(0).index())) {  // graph capture (adapters/graph.h)
    // Recorded: at replay, the CPU abs kernel on the same memory.
    at::Tensor out = graph_alias(iter.tensor(0)), in = graph_alias(iter.tensor(1));
    capture_record(c, "abs_stub(" + c10::str(in.sizes()) + ")", [out, in] {
      KernelScope on_device;
      at::abs_out(const_cast<at::Tensor&>(out), in);
    });
    return;
  }
  LaunchScope launch(current_stream(iter.device(0).index()));  // in stream order
  KernelScope on_device;                                        // device memory accessible
  // Named like the CPU kernel, so an unsupported dtype gets the CPU's message ("abs_cpu" not
  // implemented for 'Bool').
  AT_DISPATCH_V2(iter.dtype(), "abs_cpu", AT_WRAP([&] {
    iter.for_each([](char** data, const int64_t* strides, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        auto* out = reinterpret_cast<scalar_t*>(data[0] + i * strides[0]);
        *out = abs_value(*reinterpret_cast<const scalar_t*>(data[1] + i * strides[1]));
      }
    });
  }), AT_EXPAND(AT_ALL_TYPES_AND_COMPLEX), at::kHalf, at::kBFloat16, at::kComplexHalf,
      AT_EXPAND(AT_FLOAT8_TYPES));
}
// [docs:end ABS_KERNEL]

}  // namespace
}  // namespace openreg

// [docs:start REGISTER_STUB]
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(abs_stub, &openreg::abs_kernel)
}  // namespace at::native

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("abs.out", TORCH_FN(at::native::abs_out));  // ATen's device-generic abs.out
}
// [docs:end REGISTER_STUB]
