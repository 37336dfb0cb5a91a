// Native because: the simulated device driver (device count, current device, fork poisoning)
// is queried by the C++ DeviceGuard, hooks and allocator on the per-operator hot path.
#include "runtime/device.h"

#include <c10/util/Exception.h>

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace openreg {
namespace detail {
bool g_bad_fork = false;
}

namespace {

constexpr int kDefaultDeviceCount = 2;
constexpr int kMaxDeviceCount = 64;

std::atomic<bool> g_initialized{false};
std::once_flag g_atfork_once;
thread_local int tls_current_device = 0;

int read_device_count() {
  const char* env = std::getenv("OPENREG_DEVICE_COUNT");
  if (env == nullptr || *env == '\0') return kDefaultDeviceCount;
  char* end = nullptr;
  long n = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || n < 0 || n > kMaxDeviceCount) {
    // device_count() must not throw; a malformed value means "no usable device".
    return 0;
  }
  return static_cast<int>(n);
}

size_t parse_size(const char* text, size_t fallback) {
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (end == text || value <= 0) return fallback;
  std::string unit;
  for (; *end; ++end)
    if (!std::isspace(static_cast<unsigned char>(*end)))
      unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(*end))));
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb" || unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mb" || unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gb" || unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tb" || unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else return fallback;
  return static_cast<size_t>(value * mult);
}

// [docs:start ATFORK]
void mark_child_after_fork() {
  // Worker threads and device state do not survive fork(): a child of an initialised
  // process must not touch the runtime.
  if (g_initialized.load()) detail::g_bad_fork = true;
}
// [docs:end ATFORK]

}  // namespace

int device_count() noexcept {
  static const int count = read_device_count();
  return count;
}

size_t device_capacity() noexcept {
  static const size_t capacity =
      parse_size(std::getenv("OPENREG_DEVICE_MEMORY"), size_t(8) << 30);
  return capacity;
}

// [docs:start CHECK_DEVICE]
// An index out of range is an error of the device runtime, as CUDA's "invalid device ordinal":
// c10::AcceleratorError, which Python sees as torch.AcceleratorError (a RuntimeError).
void check_device(int index) {
  if (index >= 0 && index < device_count()) return;
  constexpr int32_t kInvalidDevice = 101;  // the number CUDA uses for an invalid device ordinal
  throw c10::AcceleratorError(
      {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, kInvalidDevice,
      c10::str("openreg device index is out of range: got ", index, ", but there ",
               device_count() == 1 ? "is 1 device"
                                   : ("are " + std::to_string(device_count()) + " devices"),
               " (set OPENREG_DEVICE_COUNT to change it)"));
}
// [docs:end CHECK_DEVICE]

int current_device() noexcept { return tls_current_device; }

void set_current_device(int index) {
  check_device(index);
  tls_current_device = index;
}

// [docs:start FORK]
void detail::raise_bad_fork() {
  TORCH_CHECK(
      false,
      "Cannot re-initialize OpenReg in forked subprocess. To use OpenReg with "
      "multiprocessing, you must use the 'spawn' start method");
}

void lazy_init() {
  check_not_forked();
  if (g_initialized.load(std::memory_order_acquire)) return;
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, &mark_child_after_fork); });
  TORCH_CHECK(device_count() > 0,
              "openreg: no device available (OPENREG_DEVICE_COUNT=",
              std::getenv("OPENREG_DEVICE_COUNT") ? std::getenv("OPENREG_DEVICE_COUNT") : "", ")");
  g_initialized.store(true, std::memory_order_release);
}

// [docs:end FORK]

bool is_initialized() noexcept { return g_initialized.load() && !detail::g_bad_fork; }
bool in_bad_fork() noexcept { return detail::g_bad_fork; }

DeviceProperties device_properties(int index) {
  check_device(index);
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return DeviceProperties{"OpenReg Simulated Device", device_capacity(), 1, 0,
                          static_cast<int>(cpus > 0 ? cpus : 1)};
}

}  // namespace openreg
