// Native because: graph capture records operators inside the C++ kernels (the generic fallback
// and the native kernels) and PyTorch accepts a graph implementation only as a C++
// at::GraphImplInterface.
#pragma once

#include "runtime/stream.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace openreg {

// Where a recorded operator runs at replay.
enum class ReplayOn {
  Cpu,          // its CPU kernel on CPU aliases of the device memory (the generic fallback)
  PrivateUse1,  // its openreg kernel (native kernels), results copied into the captured outputs
};

// Records `op` with the arguments on top of `stack` into `capture` instead of running it:
// output shapes come from the operator's Meta kernel, outputs are allocated now (from the
// graph's private pool), and the call is replaced by its returns, as if it had run.
// `meta_kernel`, when given, replaces the operator's Meta kernel (for operators without one): it
// receives the arguments as Meta tensors and leaves the returns on the stack.
using MetaKernel = void (*)(c10::Stack*);
void capture_op(Capture* capture, const c10::OperatorHandle& op, c10::Stack* stack, int device,
                ReplayOn replay_on, MetaKernel meta_kernel = nullptr);

// A CPU tensor over a device tensor's memory for recorded work. Memory from a graph's private
// pool is not owned (the pool keeps it for the graph); other memory (static inputs made before
// the capture) is kept alive by the graph.
at::Tensor graph_alias(const at::Tensor& device_tensor);

// [docs:start CAPTURE_TYPED]
// For a native kernel with an unboxed signature: when its stream captures, record the call and
// return the results of the capture, e.g.
//   if (Capture* c = capturing(device))
//     return capture_call<at::Tensor>(c, device, "aten::mse_loss", "", self, target, reduction);
template <class Ret, class... Args>
Ret capture_call_meta(Capture* capture, int device, const char* name, const char* overload,
                      MetaKernel meta_kernel, const Args&... args) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  c10::Stack stack = c10::impl::boxArgs<Args...>(args...);
  capture_op(capture, op, &stack, device, ReplayOn::PrivateUse1, meta_kernel);
  return c10::impl::PopResult<Ret>::call(stack);
}
template <class Ret, class... Args>
Ret capture_call(Capture* capture, int device, const char* name, const char* overload,
                 const Args&... args) {
  return capture_call_meta<Ret>(capture, device, name, overload, nullptr, args...);
}
// [docs:end CAPTURE_TYPED]

}  // namespace openreg
