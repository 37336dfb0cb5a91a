// Native because: the switch of the unboxed route (routes/unboxed.cpp), a C++ kernel.
#pragma once

namespace openreg {

// On by default. Off, the route's operators are boxed and run by the generic fallback, as
// before the route existed: tests compare the two, benchmarks measure both in one process
// (torch_openreg._C._set_unboxed_route).
void set_unboxed_route(bool enabled);
bool unboxed_route_enabled();

}  // namespace openreg
