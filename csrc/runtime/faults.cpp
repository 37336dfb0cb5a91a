// Native because: the faults fire inside the simulated driver (faults.h); this file holds what is
// armed, counts what it matches and keeps the devices' sticky errors.
#include "runtime/faults.h"

#include "runtime/device.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <optional>
#include <vector>

namespace openreg {
namespace detail {
std::atomic<bool> g_check_alloc{false};
std::atomic<bool> g_check_launch{false};
std::atomic<uint64_t> g_faulted_devices{0};
std::atomic<bool> g_collective_fault_armed{false};
}  // namespace detail

namespace {
std::mutex g_mutex;

struct OomFault {
  int device = -1;
  int64_t nth = 1;
  size_t min_bytes = 0;
  int64_t times = 1;
  int64_t seen = 0;   // matching allocations so far
  int64_t fired = 0;
} g_oom;

struct KernelFault {
  int device = -1;
  int64_t stream = -1;
  std::string op;
  int64_t nth = 1;
  std::string kind;
  int64_t seen = 0;
} g_kernel;

std::string g_device_errors[64];
int g_device_codes[64] = {};
bool g_oom_armed = false, g_kernel_armed = false;  // under g_mutex
uint64_t g_lost = 0;                                // bit d: openreg:d disappeared

// Called with g_mutex held after any change.
void update_gates() {
  detail::g_check_alloc = g_oom_armed || g_lost != 0;
  detail::g_check_launch = g_kernel_armed || g_lost != 0;
}

[[noreturn]] void raise_lost(int device) {
  // CUDA's cudaErrorDevicesUnavailable (46) is the closest code.
  throw c10::AcceleratorError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, 46,
                              g_device_errors[device]);
}

// The operators being called on this thread, outermost first, while a kernel fault is armed
// (a RecordFunction callback, the mechanism torch's profiler uses): the name of a launch.
thread_local std::vector<std::string> t_ops;
std::optional<at::CallbackHandle> g_callback;

std::unique_ptr<at::ObserverContext> op_enter(const at::RecordFunction& fn) {
  t_ops.emplace_back(fn.name());
  return nullptr;
}
void op_exit(const at::RecordFunction&, at::ObserverContext*) {
  if (!t_ops.empty()) t_ops.pop_back();
}

bool op_matches(const std::string& wanted, const std::string& name) {
  return name == wanted || (name.size() > 6 && name.compare(0, 6, "aten::") == 0 &&
                            name.compare(6, std::string::npos, wanted) == 0);
}
}  // namespace

// ---------------------------------------------------------------- out of memory

void arm_oom(int device, int64_t nth, size_t min_bytes, int64_t times) {
  if (device >= 0) check_device(device);
  TORCH_CHECK_VALUE(nth >= 1, "openreg faults: nth must be >= 1, got ", nth);
  TORCH_CHECK_VALUE(times != 0, "openreg faults: times must be positive, or negative for every "
                                "matching allocation");
  std::lock_guard lock(g_mutex);
  g_oom = OomFault{device, nth, min_bytes, times, 0, 0};
  g_oom_armed = true;
  update_gates();
}

void disarm_oom() {
  std::lock_guard lock(g_mutex);
  g_oom_armed = false;
  update_gates();
}

int64_t oom_fired() {
  std::lock_guard lock(g_mutex);
  return g_oom.fired;
}

// [docs:start OOM_FAULT_FIRES]
bool oom_fault_fires(int device, size_t requested) {
  std::lock_guard lock(g_mutex);
  if (g_lost & (uint64_t(1) << device)) raise_lost(device);
  if (!g_oom_armed || (g_oom.device >= 0 && g_oom.device != device) ||
      requested < g_oom.min_bytes)
    return false;
  if (++g_oom.seen < g_oom.nth) return false;
  ++g_oom.fired;
  if (g_oom.times > 0 && g_oom.fired >= g_oom.times) {
    g_oom_armed = false;
    update_gates();
  }
  return true;
}
// [docs:end OOM_FAULT_FIRES]

// ---------------------------------------------------------------- kernel failures

void arm_kernel_fault(int device, int64_t stream, const std::string& op, int64_t nth,
                      const std::string& kind) {
  if (device >= 0) check_device(device);
  TORCH_CHECK_VALUE(nth >= 1, "openreg faults: nth must be >= 1, got ", nth);
  TORCH_CHECK_VALUE(kind == "illegal_address" || kind == "assert",
                    "openreg faults: kind must be 'illegal_address' or 'assert', got '", kind, "'");
  std::lock_guard lock(g_mutex);
  g_kernel = KernelFault{device, stream, op, nth, kind, 0};
  if (!g_callback)
    g_callback = at::addGlobalCallback(
        at::RecordFunctionCallback(&op_enter, &op_exit).scopes({at::RecordScope::FUNCTION}));
  g_kernel_armed = true;
  update_gates();
}

void disarm_kernel_fault() {
  std::lock_guard lock(g_mutex);
  g_kernel_armed = false;
  update_gates();
  if (g_callback) {
    at::removeCallback(*g_callback);
    g_callback.reset();
  }
}

// [docs:start KERNEL_FAULT_LAUNCH]
void kernel_fault_launch(int device, int64_t stream) {
  std::string name = "an openreg kernel";
  if (!t_ops.empty()) name = t_ops.back();
  std::lock_guard lock(g_mutex);
  if (g_lost & (uint64_t(1) << device)) raise_lost(device);
  if (!g_kernel_armed || (g_kernel.device >= 0 && g_kernel.device != device) ||
      (g_kernel.stream >= 0 && g_kernel.stream != stream))
    return;
  if (!g_kernel.op.empty()) {
    // The innermost operator of that name: a launch under aten::linear's aten::addmm matches
    // both "linear" and "addmm", and is named after the one asked for.
    bool found = false;
    for (auto it = t_ops.rbegin(); it != t_ops.rend() && !found; ++it)
      if (op_matches(g_kernel.op, *it)) {
        name = *it;
        found = true;
      }
    if (!found) return;
  }
  if (++g_kernel.seen < g_kernel.nth) return;
  g_kernel_armed = false;  // fires once
  update_gates();
  if (!g_device_errors[device].empty()) return;  // the first error is the one reported
  const bool assert_kind = g_kernel.kind == "assert";
  // CUDA's error codes: cudaErrorIllegalAddress (700), cudaErrorAssert (710).
  g_device_codes[device] = assert_kind ? 710 : 700;
  g_device_errors[device] = c10::str(
      "openreg error: ", assert_kind ? "device-side assert triggered" :
                                       "an illegal memory access was encountered",
      " in kernel ", name, " launched on stream ", stream, " of openreg:", device,
      " (injected by torch.openreg.faults.kernel_error). The error is sticky: every "
      "synchronizing call on openreg:", device, " reports it until "
      "torch.openreg.faults.reset_device(", device, "); other devices are not affected.");
  detail::g_faulted_devices.fetch_or(uint64_t(1) << device);
}
// [docs:end KERNEL_FAULT_LAUNCH]

void detail::raise_device_fault(int device) {
  if (device < 0 || device >= 64 ||
      (detail::g_faulted_devices.load() & (uint64_t(1) << device)) == 0)
    return;
  std::string message;
  int code = 0;
  {
    std::lock_guard lock(g_mutex);
    message = g_device_errors[device];
    code = g_device_codes[device];
  }
  throw c10::AcceleratorError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, code,
                              message);
}

void reset_device_fault(int device) {
  check_device(device);
  std::lock_guard lock(g_mutex);
  g_device_errors[device].clear();
  g_lost &= ~(uint64_t(1) << device);
  update_gates();
  detail::g_faulted_devices.fetch_and(~(uint64_t(1) << device));
}

// [docs:start DEVICE_LOST]
void lose_device(int device) {
  check_device(device);
  std::lock_guard lock(g_mutex);
  g_device_errors[device] = c10::str(
      "openreg error: openreg:", device, " is no longer available: the device disappeared "
      "(injected by torch.openreg.faults.device_lost). Every allocation, kernel and "
      "synchronizing call on openreg:", device, " fails until "
      "torch.openreg.faults.reset_device(", device, "); other devices are not affected.");
  g_device_codes[device] = 46;  // cudaErrorDevicesUnavailable
  g_lost |= uint64_t(1) << device;
  update_gates();
  detail::g_faulted_devices.fetch_or(uint64_t(1) << device);
}
// [docs:end DEVICE_LOST]

std::string device_fault(int device) {
  check_device(device);
  std::lock_guard lock(g_mutex);
  return g_device_errors[device];
}

// ---------------------------------------------------------------- collectives

namespace {
struct CollectiveFault {
  std::string kind;
  int64_t nth = 1;
  int code = 1;
  int64_t seen = 0;
} g_collective;
}  // namespace

void arm_collective_fault(const std::string& kind, int64_t nth, int code) {
  TORCH_CHECK_VALUE(kind == "hang" || kind == "exit",
                    "openreg faults: a collective fault is 'hang' or 'exit', got '", kind, "'");
  TORCH_CHECK_VALUE(nth >= 1, "openreg faults: nth must be >= 1, got ", nth);
  std::lock_guard lock(g_mutex);
  g_collective = CollectiveFault{kind, nth, code, 0};
  detail::g_collective_fault_armed = true;
}

void disarm_collective_fault() {
  std::lock_guard lock(g_mutex);
  detail::g_collective_fault_armed = false;
}

// [docs:start COLLECTIVE_FAULT]
void collective_fault_fires(const char* what) {
  std::string kind;
  int code = 1;
  int64_t n = 0;
  {
    std::lock_guard lock(g_mutex);
    if (!detail::g_collective_fault_armed.load() || ++g_collective.seen < g_collective.nth) return;
    detail::g_collective_fault_armed = false;
    kind = g_collective.kind;
    code = g_collective.code;
    n = g_collective.seen;
  }
  std::fprintf(stderr, "openreg: injected fault (torch.openreg.faults): %s at occl collective #%lld"
               " (%s) of process %d\n", kind == "exit" ? "this rank exits" :
               "this rank hangs: the collective never completes", static_cast<long long>(n),
               what, static_cast<int>(getpid()));
  std::fflush(stderr);
  // A rank that dies: no cleanup, no exception, as a crash or an OOM kill.
  if (kind == "exit") std::_Exit(code);
  // A rank that is stuck (a deadlock, a hung data loader): it never issues the collective, and
  // stays stuck until the launcher (torchrun, multiprocessing.spawn) ends it.
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}
// [docs:end COLLECTIVE_FAULT]

}  // namespace openreg
