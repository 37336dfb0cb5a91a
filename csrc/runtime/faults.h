// Native because: injected faults fire inside the simulated driver (the caching allocator's
// malloc, the launch of a kernel on a stream, the synchronizing calls), which are native; each
// check there is one relaxed load of a flag that is false unless a fault is armed.
#pragma once

#include <c10/macros/Macros.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace openreg {

namespace detail {
// Gates of the checks, each true only while something could fire there (recomputed under the
// faults' mutex): an allocation check (an armed oom fault, a lost device), a launch check (an
// armed kernel fault, a lost device).
extern std::atomic<bool> g_check_alloc;
extern std::atomic<bool> g_check_launch;
extern std::atomic<uint64_t> g_faulted_devices;  // bit d: openreg:d has a sticky error
void raise_device_fault(int device);
}  // namespace detail
bool oom_fault_fires(int device, size_t requested);
void kernel_fault_launch(int device, int64_t stream);

// ---- out of memory (torch.openreg.faults.oom, docs/fault_injection.md)
// Arms: among the allocations on `device` (-1: any device) of at least `min_bytes`, the `nth`
// one from now fails as out of memory, and then the next `times - 1` ones (times < 0: all).
void arm_oom(int device, int64_t nth, size_t min_bytes, int64_t times);
void disarm_oom();
int64_t oom_fired();  // injected out-of-memory errors since the fault was armed
// [docs:start OOM_FAULT_CHECK]
// Called by the caching allocator for each allocation: true when this one must fail.
inline bool inject_oom(int device, size_t requested) {
  return C10_UNLIKELY(detail::g_check_alloc.load(std::memory_order_relaxed)) &&
         oom_fault_fires(device, requested);
}
// [docs:end OOM_FAULT_CHECK]

// ---- asynchronous kernel failure (torch.openreg.faults.kernel_error)
// Arms: the `nth` kernel launched on `device` (-1: any) and stream `stream` (-1: any) whose
// operator is `op` (empty: any; matched against the operators being called, innermost first)
// fails after its launch: the device gets a sticky error `kind` ("illegal_address" or
// "assert") naming the kernel, reported by every synchronizing call on it until
// reset_device_fault.
void arm_kernel_fault(int device, int64_t stream, const std::string& op, int64_t nth,
                      const std::string& kind);
void disarm_kernel_fault();
void reset_device_fault(int device);
std::string device_fault(int device);  // "" when the device has none
// [docs:start KERNEL_FAULT_CHECKS]
// Called at each kernel launch (LaunchScope, a queued kernel of the asynchronous mode).
inline void on_kernel_launch(int device, int64_t stream) {
  if (C10_UNLIKELY(detail::g_check_launch.load(std::memory_order_relaxed)))
    kernel_fault_launch(device, stream);
}
// Called by the synchronizing calls (synchronize, query, .item(), a blocking copy to the host,
// event waits): raises the device's sticky error.
inline void check_device_fault(int device) {
  if (C10_UNLIKELY(detail::g_faulted_devices.load(std::memory_order_relaxed) != 0))
    detail::raise_device_fault(device);
}
// [docs:end KERNEL_FAULT_CHECKS]

// ---- a device that disappears (torch.openreg.faults.device_lost)
// From now on every allocation, kernel launch and synchronizing call on `device` raises
// torch.AcceleratorError naming it, until reset_device_fault(device).
void lose_device(int device);

// ---- collectives (torch.openreg.faults.collective_hang / rank_exit)
// Arms: this process's `nth` occl collective from now never completes ("hang": the rank is
// stuck, its peers time out) or ends the process ("exit": the rank dies, exit code `code`).
void arm_collective_fault(const std::string& kind, int64_t nth, int code);
void disarm_collective_fault();
namespace detail {
extern std::atomic<bool> g_collective_fault_armed;
}
void collective_fault_fires(const char* what);
// Called when an occl collective starts (adapters/distributed.cpp).
inline void on_collective(const char* what) {
  if (C10_UNLIKELY(detail::g_collective_fault_armed.load(std::memory_order_relaxed)))
    collective_fault_fires(what);
}

}  // namespace openreg
