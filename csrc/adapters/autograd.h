// Native because: the exit-time flush drives the autograd engine with a graph that must hold no
// Python object, which only a graph built in C++ guarantees (see autograd.cpp).
#pragma once

#include <cstdint>

namespace openreg {

// True on the autograd engine's worker threads for devices ("pt_autograd_<n>"), where backward
// runs. Used to note those threads here and to size their OpenMP team (ops/cpu_kernel.cpp).
bool is_autograd_worker_thread();

// Called by the DeviceGuard when a thread sets its current device: notes which openreg devices
// have an autograd engine worker thread ("pt_autograd_<n>"). Cheap after a thread's first call.
void note_current_device_set(int device);

// Makes every openreg autograd worker thread finish what it holds of the last backward, so that
// nothing of it is released after the interpreter starts finalizing. Called by an atexit handler
// (torch_openreg/__init__.py) without the GIL. Never throws.
void release_autograd_graphs() noexcept;

// [docs:start FOLLOW_CALLER_API]
// Where the device threads run (autograd.cpp, FOLLOW_CALLER). Every kernel of the generic
// fallback and every kernel Inductor generates (python/module.cpp, KERNEL_LAUNCH) opens one of
// these: on a host thread it notes the core the thread runs on; on a device
// thread it moves the thread to that core if it is elsewhere, and counts the kernel for
// device_thread_stats().
class DeviceThreadPlacement {
 public:
  DeviceThreadPlacement();
  ~DeviceThreadPlacement();
  DeviceThreadPlacement(const DeviceThreadPlacement&) = delete;
  DeviceThreadPlacement& operator=(const DeviceThreadPlacement&) = delete;

 private:
  int64_t start_ns_ = 0;  // on a device thread while stats are on
  bool counted_ = false;  // in g_workers_in_kernel (a device thread while following)
};
// [docs:end FOLLOW_CALLER_API]

// On a host thread kept on the device thread's core for a backward (PIN_CALLER in autograd.cpp):
// gives it its affinity back. Called where a host thread frees device memory, the first thing
// it does for the device after backward() returns when the root's gradient dies with the call.
void release_pin_if_caller() noexcept;

// Whether device threads follow the host thread's core (on unless OPENREG_AUTOGRAD_FOLLOW_CALLER=0;
// switched off for the process once a host thread runs a kernel while a device thread does).
bool follow_caller_enabled();
void set_follow_caller(bool enabled);

// Counters of the kernels run on device threads since the last reset, for benchmarks/run.py:
// how many, the time inside them, when the first started and the last ended (CLOCK_MONOTONIC
// ns), and how many times a device thread was moved to the caller's core.
struct DeviceThreadStats {
  int64_t kernels = 0;
  int64_t busy_ns = 0;
  int64_t first_start_ns = 0;
  int64_t last_end_ns = 0;
  int64_t moves = 0;
  int64_t pins = 0;  // backward calls whose waiting host thread was kept on the device thread's core
};
DeviceThreadStats device_thread_stats();
// Resets the counters and switches them on (off: reset_device_thread_stats(false)).
void reset_device_thread_stats(bool enabled = true);

}  // namespace openreg
