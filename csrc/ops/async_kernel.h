// Native because: the asynchronous kernel mode is a branch of the generic fallback, the
// per-operator hot path (ops/fallback.cpp).
//
// The asynchronous kernel mode (OPENREG_ASYNC=1, torch.openreg.set_async; docs/async_mode.md):
// an operator served by the generic fallback returns device tensors at once, and its CPU kernel
// is queued on the current stream and run by the stream's worker thread, as a GPU runs kernels.
#pragma once

#include "ops/fallback.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>

namespace openreg {

// Process-wide, like CUDA_LAUNCH_BLOCKING: backward runs on the device's autograd thread, which
// must follow the same mode as the thread that called backward().
extern std::atomic<bool> g_async_kernels;
inline bool async_kernels_enabled() { return g_async_kernels.load(std::memory_order_relaxed); }
void set_async_kernels(bool on);

// Operators queued / run synchronously by the mode since the process started (for tests and
// benchmarks: how much of a program the mode really runs asynchronously).
struct AsyncCounts {
  int64_t queued;
  int64_t synchronous;
};
AsyncCounts async_counts();

// [docs:start ASYNC_FALLBACK_API]
// Queues the operator on the current stream of `device` and leaves its results on the stack, or
// returns false, without touching the stack, when it must run synchronously: its output
// shapes depend on the data or it returns a non-tensor, it draws random numbers, it has no
// meta kernel or its meta kernel refuses the arguments (the CPU kernel then raises the CPU's
// own error), it would resize or restride an argument, or the calling thread runs stream work.
bool async_fallback(const c10::OperatorHandle& op, c10::Stack* stack, int device,
                    const ArgSummary& s);
// [docs:end ASYNC_FALLBACK_API]

// A copy between two tensors of one device (_copy_from, ops/minimal_ops.cpp), queued on the
// device's current stream; false when it must run synchronously. Its checks were made.
bool async_device_copy(const at::Tensor& dst, const at::Tensor& src);

// fill_ / zero_ (routes/codegen.cpp: torch.zeros, torch.full, zero_grad), queued likewise.
// `memset`: reported to the profiler as a memset (zero_) rather than a kernel (fill_).
bool async_fill(const at::Tensor& self, const c10::Scalar& value, bool memset = false);

}  // namespace openreg
