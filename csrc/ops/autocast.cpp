// Native because: autocast wraps every matmul/conv/loss on the hot path of a mixed-precision
// step; PyTorch's cast policies (at::autocast::WrapFunction) are C++ templates, and a Python
// wrapper per op would add ~10 us to each of them (measured numbers in docs/autocast.md).
//
// Autocast for openreg: the kernels of the AutocastPrivateUse1 dispatch key.
//
// `torch.autocast("openreg")` turns on the AutocastPrivateUse1 key for the current thread. Every
// op then passes through that key before reaching the backend: ops registered below cast their
// floating-point openreg arguments according to a policy and redispatch; every other op falls
// through untouched. The op lists are the ones ATen itself uses for CUDA (AT_FORALL_* in
// ATen/autocast_mode.h), so a model behaves under openreg autocast as it would on a GPU:
//   lower_precision_fp  matmul, conv, linear, RNN cells, SDPA      -> autocast dtype (fp16/bf16)
//   fp32                pointwise ops prone to overflow, norms, losses -> float32
//   fp32_set_opt_dtype  softmax, log_softmax, sum, prod, cumsum    -> computed in float32
//   promote             ops mixing several inputs (cat-like)        -> widest input dtype
//   banned              binary_cross_entropy: unsafe in low precision, raises
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace openreg {

// The signatures in AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE name these types unqualified.
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

namespace {

// binary_cross_entropy takes probabilities; in float16 log(p) loses most of its precision near 0
// and 1, so autocast refuses it, as it does on CUDA, and points to the logits version.
at::Tensor binary_cross_entropy_banned(
    const at::Tensor&,
    const at::Tensor&,
    const std::optional<at::Tensor>&,
    int64_t) {
  TORCH_CHECK(
      false,
      "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast on "
      "openreg: they take probabilities, which float16 cannot represent precisely near 0 and 1. "
      "Feed the logits (before the sigmoid) to torch.nn.functional.binary_cross_entropy_with_logits "
      "or torch.nn.BCEWithLogitsLoss, which autocast runs in float32, or run this loss outside the "
      "autocast region on float32 inputs.");
}

}  // namespace

// [docs:start AUTOCAST_POLICIES]
// Ops without a policy pass through the autocast key unchanged.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define OPENREG_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define OPENREG_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define OPENREG_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define OPENREG_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(OPENREG_LOWER_PRECISION_FP)
  AT_FORALL_FP32(OPENREG_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(OPENREG_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(OPENREG_PROMOTE)
  KERNEL_PRIVATEUSEONE(stack, promote)
  KERNEL_PRIVATEUSEONE(cat, promote)
#undef OPENREG_LOWER_PRECISION_FP
#undef OPENREG_FP32
#undef OPENREG_FP32_SET_OPT_DTYPE
#undef OPENREG_PROMOTE

  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_banned));
}
// [docs:end AUTOCAST_POLICIES]

}  // namespace openreg
