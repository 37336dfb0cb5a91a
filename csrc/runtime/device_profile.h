// Native because: every openreg tensor is born in the native core (the empty/empty_strided kernels,
// the results of CPU kernels that become device tensors, the asynchronous mode's outputs), so the
// device profile's dtype check lives there, as one branch that is never taken without a profile.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>

#include <string>
#include <vector>

namespace openreg {

// [docs:start PROFILE_CHECK]
// A device profile makes the simulated devices refuse some dtypes, as a device without them
// (Apple's MPS has no float64). Set once per process, before the devices are initialised
// (torch_openreg/device_profiles.py: OPENREG_DEVICE_PROFILE, torch.openreg.set_device_profile).
namespace detail {
extern bool g_profile_active;                  // false: no profile, nothing refused
extern bool g_unsupported[static_cast<int>(c10::ScalarType::NumOptions)];
[[noreturn]] void refuse_dtype(c10::ScalarType dtype, int device);
}  // namespace detail

// Raises a TypeError naming the dtype, the device and the profile when the profile refuses
// `dtype`. Without a profile: one predictable branch.
inline void check_profile_dtype(c10::ScalarType dtype, int device) {
  if (C10_UNLIKELY(detail::g_profile_active) && detail::g_unsupported[static_cast<int>(dtype)])
    detail::refuse_dtype(dtype, device);
}
inline bool profile_refuses(c10::ScalarType dtype) {
  return C10_UNLIKELY(detail::g_profile_active) && detail::g_unsupported[static_cast<int>(dtype)];
}
// [docs:end PROFILE_CHECK]

// `dtypes`: what the profile refuses, each with its Python name (torch.float64 -> "float64") and
// the dtype suggested instead ("" for none). An empty name and list remove the profile.
struct RefusedDtype {
  c10::ScalarType dtype;
  std::string name;
  std::string instead;
};
void set_device_profile(const std::string& name, const std::vector<RefusedDtype>& dtypes);
std::string device_profile_name();

}  // namespace openreg
