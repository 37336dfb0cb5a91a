// Native because: the generic fallback is the per-operator hot path (see fallback.cpp).
#pragma once

namespace openreg {

// Registers the fallback for the aten operators whose PrivateUse1 slot holds a composite kernel
// although a CPU kernel exists (see fallback.cpp). Called once when torch_openreg._C loads.
void route_composites_to_fallback();

}  // namespace openreg
