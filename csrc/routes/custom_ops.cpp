// Native because: these are the C++ route for custom operators: a schema in TORCH_LIBRARY and
// kernels per dispatch key (PrivateUse1, Meta, AutogradPrivateUse1) written against the
// dispatcher's C++ API. (The Python route is torch_openreg/custom_ops.py.)
//
// Route: custom operators. A backend can add operators of its own, in its own namespace, that
// behave like aten operators: called as torch.ops.openreg.<name>, dispatched per device, shape
// inference on the Meta device (what FakeTensor and torch.compile use), and autograd.
//
//   openreg::custom_abs                       |x|; a Meta kernel; backward grad * sgn(x)
//   openreg::custom_autograd_fn_returns_self  returns its input itself; backward grad * 0.5
//   openreg::custom_autograd_fn_aliasing      returns a view of its input; backward grad * 0.5
// The two identity-like operators scale their gradient so that a test can tell their backward
// ran (rather than autograd treating them as a plain view); both work under torch.compile.
#include "adapters/graph.h"
#include "ops/cpu_kernel.h"
#include "routes/call_counter.h"
#include "runtime/device.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace openreg {
namespace {

// [docs:start SCHEMAS]
TORCH_LIBRARY(openreg, m) {
  m.def("custom_abs(Tensor input) -> Tensor");
  // (a) in the schema: the result aliases the input (the same tensor, or a view of it).
  m.def("custom_autograd_fn_returns_self(Tensor(a) input) -> Tensor(a)");
  m.def("custom_autograd_fn_aliasing(Tensor(a) input) -> Tensor(a)");
}
// [docs:end SCHEMAS]

std::atomic<int64_t>& abs_calls = call_counter("custom_ops.custom_abs");

// [docs:start CUSTOM_ABS_KERNELS]
// One dtype rule on every device, with aten's error types: a kernel rejects a dtype with
// NotImplementedError; a Meta kernel with RuntimeError (FakeTensor would turn a Meta kernel's
// NotImplementedError into "unsupported operator").
void check_floating(const at::Tensor& input, bool meta) {
  const bool ok = at::isFloatingType(input.scalar_type());
  if (meta) TORCH_CHECK(ok, "\"custom_abs\" not implemented for '", input.scalar_type(), "'");
  TORCH_CHECK_NOT_IMPLEMENTED(ok, "\"custom_abs\" not implemented for '", input.scalar_type(), "'");
}

// openreg: the computation, on the device memory.
at::Tensor custom_abs_openreg(const at::Tensor& input) {
  check_floating(input, /*meta=*/false);
  abs_calls.fetch_add(1, std::memory_order_relaxed);
  if (Capture* c = capturing(input.device().index()))  // graph capture (adapters/graph.h)
    return capture_call<at::Tensor>(c, input.device().index(), "openreg::custom_abs", "", input);
  HostKernel k(input.device().index());
  return k.result(at::abs(k.alias(input)));
}

// Meta: only the result's metadata (shape, strides, dtype): FakeTensor and torch.compile use it.
at::Tensor custom_abs_meta(const at::Tensor& input) {
  check_floating(input, /*meta=*/true);
  return at::empty_like(input);
}
// [docs:end CUSTOM_ABS_KERNELS]

// [docs:start CUSTOM_ABS_AUTOGRAD]
// Autograd: a torch::autograd::Function; forward redispatches below autograd to the device kernel.
at::Tensor custom_abs(const at::Tensor& input) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("openreg::custom_abs", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(input);
}

struct CustomAbs : public torch::autograd::Function<CustomAbs> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input) {
    ctx->save_for_backward({input});
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return custom_abs(input);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor input = ctx->get_saved_variables()[0];
    return {grads[0] * input.sgn()};
  }
};
// [docs:end CUSTOM_ABS_AUTOGRAD]

// [docs:start ALIASING_OPS]
// Device-independent bodies, registered for openreg and Meta: the input itself, or a new view of
// the same memory (what the (a) annotation of the schema promises).
at::Tensor returns_self(const at::Tensor& input) { return input; }
at::Tensor aliasing(const at::Tensor& input) { return at::alias(input); }

template <at::Tensor (*Body)(const at::Tensor&)>
struct HalfGradient : public torch::autograd::Function<HalfGradient<Body>> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return Body(input);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0] * 0.5};
  }
};
// [docs:end ALIASING_OPS]

at::Tensor returns_self_autograd(const at::Tensor& input) {
  return HalfGradient<returns_self>::apply(input);
}
at::Tensor aliasing_autograd(const at::Tensor& input) {
  return HalfGradient<aliasing>::apply(input);
}
at::Tensor custom_abs_autograd(const at::Tensor& input) { return CustomAbs::apply(input); }

// [docs:start REGISTRATIONS]
TORCH_LIBRARY_IMPL(openreg, PrivateUse1, m) {
  m.impl("custom_abs", custom_abs_openreg);
  m.impl("custom_autograd_fn_returns_self", returns_self);
  m.impl("custom_autograd_fn_aliasing", aliasing);
}

TORCH_LIBRARY_IMPL(openreg, Meta, m) {
  m.impl("custom_abs", custom_abs_meta);
  m.impl("custom_autograd_fn_returns_self", returns_self);
  m.impl("custom_autograd_fn_aliasing", aliasing);
}

TORCH_LIBRARY_IMPL(openreg, AutogradPrivateUse1, m) {
  m.impl("custom_abs", custom_abs_autograd);
  m.impl("custom_autograd_fn_returns_self", returns_self_autograd);
  m.impl("custom_autograd_fn_aliasing", aliasing_autograd);
}
// [docs:end REGISTRATIONS]

}  // namespace
}  // namespace openreg
