// Native because: PyTorch only accepts device generators as C++ c10::GeneratorImpl objects,
// returned by the PrivateUse1 hooks.
#pragma once

#include <ATen/core/Generator.h>

namespace openreg {

// The default generator of an openreg device (per device, seedable, state get/set).
const at::Generator& default_generator(int device);
at::Generator new_generator(int device);

// The CPU generator whose state an openreg generator advances: CPU kernels run by the generic
// fallback only accept CPU generators, so random ops draw from this one. `gen` may be undefined
// (the device's default generator is used).
at::Generator cpu_generator_for(const std::optional<at::Generator>& gen, int device);

}  // namespace openreg
