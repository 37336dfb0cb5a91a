// Native because: the generic fallback is the per-operator hot path (see fallback.cpp).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace openreg {

// The generic fallback itself, for boxed kernels that do something first and then let the
// fallback run the operator (routes/op_fallback.cpp).
void generic_fallback(const c10::OperatorHandle& op, c10::Stack* stack);

// Registers the fallback for the aten operators whose PrivateUse1 slot holds a composite kernel
// although a CPU kernel exists (see fallback.cpp). Called once when torch_openreg._C loads.
void route_composites_to_fallback();

}  // namespace openreg
