// Native because: the occl c10d backend (distributed.cpp) must be a C++ c10d::Backend.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <pybind11/pybind11.h>

namespace openreg {

// An occl backend running its collectives through `gloo` (a ProcessGroupGloo of the same group
// rank and size) on CPU aliases of the device memory. torch_openreg/distributed.py creates both.
// With `check`, every collective first compares its shapes across the group (docs/distributed.md).
c10::intrusive_ptr<c10d::Backend> make_occl_backend(c10::intrusive_ptr<c10d::Backend> gloo,
                                                    bool check = true);

// torch_openreg._C._OcclBackend, the Python type of occl backends.
void bind_occl_backend(pybind11::module_& m);

}  // namespace openreg
