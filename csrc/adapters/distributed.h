// Native because: the occl c10d backend (distributed.cpp) must be a C++ c10d::Backend.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace openreg {

// An occl backend running its collectives through `gloo` (a ProcessGroupGloo of the same group
// rank and size) on CPU aliases of the device memory. torch_openreg/distributed.py creates both.
c10::intrusive_ptr<c10d::Backend> make_occl_backend(c10::intrusive_ptr<c10d::Backend> gloo);

}  // namespace openreg
