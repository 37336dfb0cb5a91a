// Native because: autocast policies are kernels of the AutocastPrivateUse1 dispatch key, and
// ATen's policy template (at::autocast::WrapFunction, KERNEL_PRIVATEUSEONE) is C++ only.
//
// Optional mechanism of minidev: autocast (docs/autocast.md). setup.py builds it as its own
// extension, minidev._autocast; minidev/__init__.py imports it when it is there and then lists
// the autocast dtypes. Without it, the core passes every required check.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/extension.h>

// [docs:start AUTOCAST]
// ATen's op lists name these types unqualified (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE): they
// compile only where Tensor, Scalar, ScalarType and IntArrayRef are in scope.
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

// Every operator without a policy passes through the autocast key to the device's kernel.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

// The policies CUDA uses, from ATen's lists: matmuls and convolutions in the autocast dtype,
// reductions, softmax, norms and losses in float32, mixed-type ops promoted to the widest type.
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define MINIDEV_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define MINIDEV_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define MINIDEV_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define MINIDEV_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(MINIDEV_LOWER)
  AT_FORALL_FP32(MINIDEV_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(MINIDEV_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(MINIDEV_PROMOTE)
}
// [docs:end AUTOCAST]

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}  // importing the module registers the kernels
