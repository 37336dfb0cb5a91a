// Native because: the exit-time flush drives the autograd engine with a graph that must hold no
// Python object, which only a graph built in C++ guarantees: a tensor made in Python owns a
// Python object that the worker thread would release.
//
// [docs:start EXIT_FLUSH]
// Backward of openreg work runs on the engine's worker thread for the device, as on CUDA. That
// thread holds the backward's GraphTask a moment after backward() has returned to the caller,
// and in torch 2.13 the GraphTask holds Python objects (torch.autograd.backward stashes the
// caller's contextvars in the thread-local state it captures). If the script ends in that
// moment, the worker releases them while the interpreter finalizes: it asks for the GIL, Python
// ends the thread with pthread_exit, and the unwinding through a noexcept destructor aborts the
// process ("terminate called without an active exception", exit code 134), about once in 6 to
// 40 runs of a short training script. The same engine behaves the same on any device with
// worker threads.
//
// The fix, at interpreter exit (an atexit handler runs before finalization starts): send one
// tiny backward through each openreg worker thread, built in C++ so that it holds no Python
// object. A device's queue is served by that one thread in order, so when the probe's backward
// returns, the thread has finished every task before it, including the release of the user's
// last GraphTask, while Python could still take the GIL. A worker stuck in a backward that never
// ends (a daemon thread's) delays the exit by a few seconds at most, never hangs it.
// [docs:end EXIT_FLUSH]
#include "adapters/autograd.h"

#include "runtime/device.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

namespace openreg {
namespace {

// Bit d: the engine has a worker thread for openreg:d (it set that device when it started).
// Devices beyond the mask's width are not tracked (and not flushed at exit).
constexpr int kTrackedDevices = 64;
std::atomic<uint64_t> g_worker_devices{0};

constexpr auto kExitWait = std::chrono::seconds(5);

// One tiny backward per openreg device whose worker thread exists, built in C++ (no Python
// object in it).
void probe_worker_threads(uint64_t devices) noexcept {
  // The probe must build a graph whatever the caller's modes; anomaly mode would attach a
  // Python traceback to its node, so it is off for the probe.
  c10::AutoGradMode grad(true);
  c10::InferenceMode no_inference(false);
  const bool anomaly = torch::autograd::AnomalyMode::is_enabled();
  const bool check_nan = torch::autograd::AnomalyMode::should_check_nan();
  torch::autograd::AnomalyMode::set_enabled(false);
  for (int d = 0; d < device_count() && d < kTrackedDevices; ++d) {
    if ((devices & (uint64_t{1} << d)) == 0) continue;
    try {
      auto options = at::TensorOptions().device(c10::DeviceType::PrivateUse1,
                                                static_cast<c10::DeviceIndex>(d));
      at::Tensor leaf = at::zeros({1}, options).requires_grad_(true);
      torch::autograd::backward({leaf}, {at::zeros({1}, options)});
    } catch (...) {
      // Exiting anyway: a device that cannot run the probe is left as it is.
    }
  }
  torch::autograd::AnomalyMode::set_enabled(anomaly, check_nan);
}

}  // namespace

bool is_autograd_worker_thread() {
  char name[16] = {0};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) return false;
  return std::strncmp(name, "pt_autograd_", 12) == 0;
}

void note_current_device_set(int device) {
  thread_local const bool worker = is_autograd_worker_thread();
  if (worker && device >= 0 && device < kTrackedDevices)
    g_worker_devices.fetch_or(uint64_t{1} << device, std::memory_order_relaxed);
}

void release_autograd_graphs() noexcept {
  const uint64_t devices = g_worker_devices.load();
  if (devices == 0 || in_bad_fork()) return;
  // The probe runs on a thread of its own, so that a worker stuck in a backward that never ends
  // (started by a daemon thread, say) delays the exit by kExitWait at most instead of hanging it.
  struct Done {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  try {
    std::thread([devices, done] {
      probe_worker_threads(devices);
      std::lock_guard lock(done->mutex);
      done->done = true;
      done->cv.notify_all();
    }).detach();
  } catch (...) {
    return;  // no thread could be started: exiting without the flush
  }
  std::unique_lock lock(done->mutex);
  done->cv.wait_for(lock, kExitWait, [&] { return done->done; });
}

}  // namespace openreg
