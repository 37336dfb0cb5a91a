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

namespace {
const cpu_set_t g_process_affinity = [] {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(cpu_set_t), &set) != 0) {
    CPU_ZERO(&set);
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) CPU_SET(cpu, &set);
  }
  return set;
}();
}  // namespace

const cpu_set_t& process_affinity() { return g_process_affinity; }
namespace detail {
bool g_bad_fork = false;
std::atomic<int> g_known_device_count{0};
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

// [docs:start PARSE_SIZE]
// "8589934592", "1e9", "512MiB", "512MB", "2 GB", "1.5g": a number with an optional binary unit
// (k/m/g/t, kb/mb/gb/tb or kib/mib/gib/tib, all powers of 1024, as nvidia-smi and PyTorch print
// sizes). Returns 0 (and sets `error`) on anything else.
size_t parse_size(const char* text, std::string& error) {
  char* end = nullptr;
  double value = std::strtod(text, &end);
  std::string unit;
  for (const char* c = end; c && *c; ++c)
    if (!std::isspace(static_cast<unsigned char>(*c)))
      unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(*c))));
  double mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb" || unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mb" || unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gb" || unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tb" || unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  if (end == text || mult == 0 || !(value * mult >= 1) || value * mult > 1e18) {
    error = std::string("OPENREG_DEVICE_MEMORY='") + text +
            "' is not a valid memory size: expected a positive number of bytes with an optional "
            "unit, for example 8GB, 512MiB or 1e9";
    return 0;
  }
  return static_cast<size_t>(value * mult);
}
// [docs:end PARSE_SIZE]

struct Capacity {
  size_t bytes = size_t(8) << 30;  // default: 8 GiB per device
  std::string error;
};

const Capacity& capacity_setting() {
  static const Capacity c = [] {
    Capacity c;
    const char* env = std::getenv("OPENREG_DEVICE_MEMORY");
    if (env != nullptr && *env != '\0') c.bytes = parse_size(env, c.error);
    return c;
  }();
  return c;
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
  static const int count = [] {
    const int n = read_device_count();
    // check_device's inline test from now on
    detail::g_known_device_count.store(n, std::memory_order_relaxed);
    return n;
  }();
  return count;
}

size_t device_capacity() {
  const Capacity& c = capacity_setting();
  TORCH_CHECK(c.error.empty(), c.error);
  return c.bytes;
}

// [docs:start CHECK_DEVICE]
// An index out of range is an error of the device runtime, as CUDA's "invalid device ordinal":
// c10::AcceleratorError, which Python sees as torch.AcceleratorError (a RuntimeError).
// (check_device, inline in device.h, comes here for the first check and for an index out of
// range.)
void detail::check_device_slow(int index) {
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
  device_capacity();  // a malformed OPENREG_DEVICE_MEMORY fails the first use, clearly
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
