// Native because: the profile's dtype check runs where device tensors are born, in the native
// core (device_profile.h); this file holds its state and its error.
#include "runtime/device_profile.h"

#include "runtime/device.h"

#include <c10/util/Exception.h>

#include <mutex>

namespace openreg {
namespace detail {
bool g_profile_active = false;
bool g_unsupported[static_cast<int>(c10::ScalarType::NumOptions)] = {};
}  // namespace detail

namespace {
std::mutex g_mutex;
std::string g_name;
std::vector<RefusedDtype> g_refused;
}  // namespace

// [docs:start REFUSE_DTYPE]
// The wording follows MPS's for float64 ("Cannot convert a MPS Tensor to float64 dtype as the MPS
// framework doesn't support float64. Please use float32 instead."), a TypeError as there, and adds
// the device and the profile that refuses it.
void detail::refuse_dtype(c10::ScalarType dtype, int device) {
  std::string name = c10::toString(dtype), instead, profile;
  {
    std::lock_guard lock(g_mutex);
    profile = g_name;
    for (const auto& r : g_refused)
      if (r.dtype == dtype) {
        name = r.name;
        instead = r.instead;
      }
  }
  TORCH_CHECK_TYPE(false, "Cannot create or convert an openreg Tensor to ", name,
                   " dtype on openreg:", device, " as the device profile '", profile,
                   "' doesn't support ", name, " (set by OPENREG_DEVICE_PROFILE or "
                   "torch.openreg.set_device_profile; docs/device_profiles.md).",
                   instead.empty() ? std::string() : " Please use " + instead + " instead.");
}
// [docs:end REFUSE_DTYPE]

void set_device_profile(const std::string& name, const std::vector<RefusedDtype>& dtypes) {
  TORCH_CHECK(!is_initialized(),
              "torch.openreg.set_device_profile must be called before openreg is initialized "
              "(before the first tensor, stream or synchronize on an openreg device); set "
              "OPENREG_DEVICE_PROFILE in the environment to choose it for the whole process");
  std::lock_guard lock(g_mutex);
  for (bool& b : detail::g_unsupported) b = false;
  for (const auto& r : dtypes) detail::g_unsupported[static_cast<int>(r.dtype)] = true;
  g_name = name;
  g_refused = dtypes;
  detail::g_profile_active = !dtypes.empty();
}

std::string device_profile_name() {
  std::lock_guard lock(g_mutex);
  return g_name;
}

}  // namespace openreg
