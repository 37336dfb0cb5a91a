// Native because: it runs inside a CPU kernel call on the autograd device thread, on the per-op
// hot path of backward, and hands work to other threads without the GIL.
//
// Matrix products on the autograd device threads, split over rows between the device thread and
// helper threads (split_matmul.cpp, MATMUL_SPLIT; docs/autograd.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace openreg {

// On a device thread, while the host threads run more than one OpenMP thread: the product of
// the CPU aliases computed by the device thread and helper threads, each with one OpenMP thread,
// into a result allocated like the CPU kernel's (inside the HostKernel: device memory).
// std::nullopt when the product is not split (another thread, too small, an argument the
// CPU kernel must check or refuse itself): the caller then runs the CPU kernel.
std::optional<at::Tensor> split_mm(const at::Tensor& a, const at::Tensor& b);
std::optional<at::Tensor> split_addmm(const at::Tensor& self, const at::Tensor& a,
                                      const at::Tensor& b, const c10::Scalar& beta,
                                      const c10::Scalar& alpha);
std::optional<at::Tensor> split_bmm(const at::Tensor& a, const at::Tensor& b);
// The out= forms (Inductor's extern kernels): true when the product was written into `out`.
bool split_mm_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out);
bool split_addmm_out(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                     const c10::Scalar& beta, const c10::Scalar& alpha, const at::Tensor& out);
bool split_bmm_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out);

// Notes the intra-op thread count of a host thread's kernel (DeviceThreadPlacement): how many
// threads a product on a device thread may use.
void note_host_threads(int threads);

// On unless OPENREG_AUTOGRAD_SPLIT_MATMUL=0.
bool matmul_split_enabled();
void set_matmul_split(bool enabled);

}  // namespace openreg
