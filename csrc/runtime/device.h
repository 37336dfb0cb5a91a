// Native because: this is the simulated device driver (the role libcudart plays for CUDA); the
// PyTorch adapters in csrc/adapters call it from C++ on every operator.
#pragma once

#include <sched.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace openreg {

// Number of simulated devices: OPENREG_DEVICE_COUNT, default 2. Never throws.
int device_count() noexcept;

// Throws c10::AcceleratorError (Python torch.AcceleratorError, a RuntimeError) naming the index
// and the count when out of range, as CUDA does for an invalid device ordinal. Inline: a tiny
// operator checks its device about five times (route, stream, allocator), and the out-of-line
// call with device_count()'s guard was 140 instructions of a 4-element add (docs/fallback.md).
inline void check_device(int index);

// The calling thread's current device (starts at 0, like CUDA).
int current_device() noexcept;
void set_current_device(int index);  // checked

// Lazy initialisation of the runtime. Raises after a fork of an initialised process.
void lazy_init();
bool is_initialized() noexcept;
bool in_bad_fork() noexcept;
// Cheap check used on hot paths (allocation, stream use): raises in a bad fork.
inline void check_not_forked();

struct DeviceProperties {
  std::string name;
  size_t total_memory;
  int major;
  int minor;
  int multi_processor_count;
};
DeviceProperties device_properties(int index);

// Per-device memory capacity in bytes: OPENREG_DEVICE_MEMORY (e.g. "2GB", "512MiB", "1e9"),
// default 8 GiB. Raises (RuntimeError) naming the variable when its value is malformed.
size_t device_capacity();

namespace detail {
void raise_bad_fork();
extern bool g_bad_fork;
// device_count() once it has been asked (0 before): the count is fixed from its first call on.
extern std::atomic<int> g_known_device_count;
// The first check (which reads the count) and every failing one.
void check_device_slow(int index);
}  // namespace detail

inline void check_device(int index) {
  const int known = detail::g_known_device_count.load(std::memory_order_relaxed);
  if (__builtin_expect(unsigned(index) < unsigned(known), true)) return;
  detail::check_device_slow(index);
}

inline void check_not_forked() {
  if (__builtin_expect(detail::g_bad_fork, false)) detail::raise_bad_fork();
}

// The CPU affinity of the thread that loaded openreg, taken at load. Threads the runtime moves
// or starts get it back (a thread starts with its starter's affinity, and an autograd device
// thread may be kept on one core while it follows its caller, adapters/autograd.cpp).
const cpu_set_t& process_affinity();

}  // namespace openreg
