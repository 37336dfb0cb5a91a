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
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace openreg {
namespace {

// Bit d: the engine has a worker thread for openreg:d (it set that device when it started).
// Devices beyond the mask's width are not tracked (and not flushed at exit).
constexpr int kTrackedDevices = 64;
std::atomic<uint64_t> g_worker_devices{0};

constexpr auto kExitWait = std::chrono::seconds(5);

// One tiny backward per openreg device whose worker thread exists, built in C++ (no Python
// object in it), of empty tensors: the device thread may hold the probe's own graph a moment
// after it returns, and that graph holds no device memory.
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
      at::Tensor leaf = at::zeros({0}, options).requires_grad_(true);
      torch::autograd::backward({leaf}, {at::zeros({0}, options)});
    } catch (...) {
      // Exiting anyway: a device that cannot run the probe is left as it is.
    }
  }
  torch::autograd::AnomalyMode::set_enabled(anomaly, check_nan);
}

}  // namespace

// Where the device threads run: see FOLLOW_CALLER below.
namespace {

// On unless OPENREG_AUTOGRAD_FOLLOW_CALLER=0.
bool follow_from_env() {
  const char* env = std::getenv("OPENREG_AUTOGRAD_FOLLOW_CALLER");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

std::atomic<bool> g_follow{follow_from_env()};
std::atomic<int> g_caller_cpu{-1};        // the core of the last host-thread kernel
std::atomic<int> g_workers_in_kernel{0};  // device threads inside a kernel now
std::atomic<int> g_moved_workers{0};      // device threads placed on a caller's core

// The set of the one core `cpu` (below CPU_SETSIZE).
cpu_set_t only_core(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return one;
}

// The thread ids of the device threads placed on a caller's core.
std::mutex g_moved_mutex;
std::vector<pid_t>& moved_workers() {
  static auto* workers = new std::vector<pid_t>();  // never destroyed: used at exit
  return *workers;
}

// A thread's placement state: one thread_local, constant-initialized (no guard), so that a
// kernel's placement costs one TLS lookup.
struct PlacementThread {
  int role = -1;       // -1 not known yet, 0 host thread, 1 device (autograd) thread
  int cpu = -1;        // host: the core last noted; device: the core it was moved to
  int depth = 0;       // nested kernels of this thread
  int epoch = 0;       // the g_placement_epoch it last saw (device thread)
  pid_t tid = 0;       // this thread's id, once known
  int pin_task = -1;   // device thread: the graph task it last pinned for
};
thread_local PlacementThread t_place;

std::atomic<bool> g_stats{false};
std::atomic<int64_t> g_stat_kernels{0}, g_stat_busy{0}, g_stat_first{0}, g_stat_last{0},
    g_stat_moves{0};

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Bumped when the device threads get the process's affinity back: a device thread then forgets
// the core it was moved to.
std::atomic<int> g_placement_epoch{0};

void restore_moved_workers_locked() {
  g_placement_epoch.fetch_add(1);
  // What they get back: the affinity of the thread that loaded openreg (a device thread started
  // later inherits whatever its starter had at that moment, a caller's temporary pin included).
  for (pid_t tid : moved_workers()) sched_setaffinity(tid, sizeof(cpu_set_t), &process_affinity());
  moved_workers().clear();
  g_moved_workers.store(0);
}

void release_pinned_caller_locked();

void stop_following() {
  std::lock_guard lock(g_moved_mutex);
  g_follow.store(false);
  restore_moved_workers_locked();
  release_pinned_caller_locked();
}

// On a device thread: moves it to `cpu` (the caller runs there, so it is allowed; the kernel
// refuses cores outside the process's cpuset), noting the thread to give it back its affinity.
void move_to(int cpu) {
  std::lock_guard lock(g_moved_mutex);
  if (!g_follow.load()) return;
  const pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
  auto& moved = moved_workers();
  if (std::find(moved.begin(), moved.end(), tid) == moved.end()) {
    moved.push_back(tid);
    g_moved_workers.fetch_add(1);
  }
  if (cpu < CPU_SETSIZE) {
    const cpu_set_t one = only_core(cpu);
    if (sched_setaffinity(0, sizeof(cpu_set_t), &one) == 0) {
      g_stat_moves.fetch_add(1, std::memory_order_relaxed);
      t_place.cpu = cpu;
      return;
    }
  }
  t_place.cpu = -2 - cpu;  // refused (outside the cpuset): not tried again until the caller moves
}

// On a device thread moved to a caller's core, when there is no core to follow any more (the
// caller runs more than one OpenMP thread): gives it the process's affinity back.
void unmove_self() {
  std::lock_guard lock(g_moved_mutex);
  const pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
  auto& moved = moved_workers();
  const auto it = std::find(moved.begin(), moved.end(), tid);
  if (it != moved.end()) {
    moved.erase(it);
    g_moved_workers.fetch_sub(1);
    sched_setaffinity(0, sizeof(cpu_set_t), &process_affinity());
  }
  t_place.cpu = -1;
}

// [docs:start PIN_CALLER]
// The host thread waiting for a backward is kept on the device thread's core until that backward
// ends: the scheduler then wakes it there, where the device thread is about to go to sleep,
// instead of on another core that may be idle (waking an idle core is the slow part of a handoff
// on a virtual machine). g_pinned_caller is its thread id (0: none); the rest is under
// g_moved_mutex. Its own affinity comes back at the first of: the engine dropping the backward's
// GraphTask (CallerPin, held by one of the GraphTask's final callbacks), its next kernel, its next
// free of device memory (release_pin_if_caller: the gradient backward() makes for its root dies
// on the caller as backward() returns), or a fork; an affinity the user set in between is kept.
// The engine drops the GraphTask on the device thread right after waking the caller, but the
// caller, just woken, often runs first (a third of the backward calls of a small model returned
// still pinned before the free released it).
std::atomic<pid_t> g_caller_tid{0};      // the host thread of the last host kernel
std::atomic<pid_t> g_pinned_caller{0};
cpu_set_t g_pinned_caller_saved;         // its affinity before
int g_pinned_caller_cpu = -1;            // the core it was pinned to
int64_t g_pin_generation = 0;            // counts the pins
std::atomic<int64_t> g_stat_pins{0};

pid_t current_tid(PlacementThread& p) {
  if (p.tid == 0) p.tid = static_cast<pid_t>(syscall(SYS_gettid));
  return p.tid;
}
pid_t current_tid() { return current_tid(t_place); }

// Gives the pinned caller its affinity back, unless it was changed since (then the new one is
// kept). Under g_moved_mutex.
void release_pinned_caller_locked() {
  const pid_t tid = g_pinned_caller.exchange(0);
  if (tid == 0) return;
  cpu_set_t now;
  if (sched_getaffinity(tid, sizeof(cpu_set_t), &now) != 0) return;  // thread gone
  const cpu_set_t one = only_core(g_pinned_caller_cpu);
  if (CPU_EQUAL(&now, &one)) sched_setaffinity(tid, sizeof(cpu_set_t), &g_pinned_caller_saved);
}

// Gives the pin `generation` back if it is still the one held.
void release_pinned_caller(pid_t tid, int64_t generation = -1) {
  std::lock_guard lock(g_moved_mutex);
  if (g_pinned_caller.load() == tid && (generation < 0 || generation == g_pin_generation))
    release_pinned_caller_locked();
}

// Lives as long as the backward's GraphTask (held by a final callback of it). The engine drops
// the GraphTask after it has woken the caller: on the caller's thread before backward() returns,
// or on the device thread once that runs again.
struct CallerPin {
  CallerPin(pid_t tid, int64_t generation) : tid(tid), generation(generation) {}
  CallerPin(const CallerPin&) = delete;
  CallerPin& operator=(const CallerPin&) = delete;
  ~CallerPin() { release_pinned_caller(tid, generation); }
  const pid_t tid;
  const int64_t generation;
};

// On a device thread running on `cpu`, once per backward: keeps the host thread `tid` (the one
// that ran the last host kernel, waiting for this backward) on `cpu` until the backward ends.
void pin_caller(pid_t tid, int cpu) {
  int64_t generation;
  {
    std::lock_guard lock(g_moved_mutex);
    if (!g_follow.load() || g_pinned_caller.load() != 0) return;
    cpu_set_t saved;
    if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(tid, sizeof(cpu_set_t), &saved) != 0 ||
        !CPU_ISSET(cpu, &saved) || CPU_COUNT(&saved) == 1)
      return;  // not allowed there, already on one core, or gone
    const cpu_set_t one = only_core(cpu);
    if (sched_setaffinity(tid, sizeof(cpu_set_t), &one) != 0) return;
    g_pinned_caller_saved = saved;
    g_pinned_caller_cpu = cpu;
    generation = ++g_pin_generation;
    g_pinned_caller.store(tid);
  }
  try {
    auto pin = std::make_shared<CallerPin>(tid, generation);
    // Throws outside a backward (no current graph task).
    torch::autograd::Engine::get_default_engine().queue_callback([pin] {});
  } catch (...) {
    release_pinned_caller(tid, generation);
    return;
  }
  g_stat_pins.fetch_add(1, std::memory_order_relaxed);
}

// [docs:end PIN_CALLER]

// A forked child has none of the parent's threads: it must not adjust threads by the parent's
// thread ids (in the child they may name threads of other processes). A caller still pinned
// gets its affinity back before it forks, so that the child does not start on one core.
[[maybe_unused]] const int g_fork_handler = pthread_atfork(
    [] {
      const pid_t tid = current_tid();
      if (g_pinned_caller.load() == tid) release_pinned_caller(tid);
    },
    nullptr,
    [] {
      new (&g_moved_mutex) std::mutex();
      moved_workers().clear();
      g_moved_workers.store(0);
      g_workers_in_kernel.store(0);
      g_caller_tid.store(0);
      g_pinned_caller.store(0);
      t_place.tid = 0;  // the child's thread has an id of its own
    });

}  // namespace

void release_pin_if_caller() noexcept {
  if (g_pinned_caller.load(std::memory_order_relaxed) == 0) return;
  const pid_t tid = current_tid();
  if (g_pinned_caller.load(std::memory_order_relaxed) == tid) release_pinned_caller(tid);
}

// [docs:start FOLLOW_CALLER]
// The device thread follows the caller's core. The thread that calls backward() waits while the
// device thread runs it; left to itself, the scheduler wakes the device thread on the core it
// last ran on, the other one, and every step then moves the step's data between the two cores'
// caches: the gradients written on one core are read by the optimizer on the other, the weights
// read by forward on one core are read by backward on the other. Measured on the 2-core machine
// with OMP_NUM_THREADS=1 (MLP 784-256-256-10, batch 64, forward / backward / optimizer, ms):
// CPU 0.33 / 0.42 / 0.26; openreg 0.37 / 0.63 / 0.45; openreg with the whole process on one core
// (taskset -c 0) 0.35 / 0.48 / 0.34. So each kernel of a host thread notes the core it runs on
// (before the first backward, only its first kernel does: no device thread follows it yet),
// and each kernel of a device thread first moves the thread there if it is elsewhere (one
// sched_setaffinity, only when the caller's core changed). That is right while the host thread
// waits for the device thread, as in backward(); when both run kernels at the same time (user
// threads running forward while another backward runs, or the device threads of two devices
// in one backward), sharing one core would serialise them: the first time a thread starts a
// kernel while a device thread is inside one, the device threads get the process's affinity back
// and stop following, for the rest of the process.
// Following alone is not enough on an idle machine: when the device thread wakes the caller at
// the end of backward, the device thread is still running on the caller's core, so the scheduler
// wakes the caller on the idle core (on this VM, through the hypervisor: 90 us), and the device
// thread chases it at the next backward. So the device thread also keeps the caller on its core
// for the duration of the backward (pin_caller, PIN_CALLER above): measured on the idle machine,
// OMP_NUM_THREADS=1, a backward of one small kernel took 26 us instead of 106 us (CPU 16 us),
// the MLP step 1.16-1.20x the CPU instead of 1.37-1.39x (docs/autograd.md).
// On by default; OPENREG_AUTOGRAD_FOLLOW_CALLER=0 leaves the placement to the scheduler. On a
// loaded machine, where no core is idle, there is nothing to gain, and sharing one core cost up to
// 2-4% in some runs (docs/autograd.md).
DeviceThreadPlacement::DeviceThreadPlacement() {
  PlacementThread& p = t_place;
  if (p.depth++ > 0) return;
  if (p.role < 0) p.role = is_autograd_worker_thread() ? 1 : 0;
  if (p.role == 0) {
    if (!g_follow.load(std::memory_order_relaxed)) return;
    // No device thread yet (no backward has run on openreg): the core is noted at the thread's
    // first kernel, for the first backward, and not again until a device thread exists.
    if (p.cpu != -1 && g_worker_devices.load(std::memory_order_relaxed) == 0) return;
    const pid_t tid = current_tid(p);
    if (g_pinned_caller.load(std::memory_order_relaxed) == tid) release_pinned_caller(tid);
    if (g_caller_tid.load(std::memory_order_relaxed) != tid)
      g_caller_tid.store(tid, std::memory_order_relaxed);
    // With more than one OpenMP thread there is nothing to follow: the team's workers wait for
    // the next parallel region spinning on the other cores, so no core is idle, and sharing one
    // core with the device thread made backward slower (MLP step 1.19-1.25x the CPU without,
    // 1.26-1.32x with; CNN 1.03-1.15x against 1.08-1.25x, default threads on 2 cores).
    const int cpu = at::get_num_threads() == 1 ? sched_getcpu() : -1;
    if (cpu != p.cpu) {
      p.cpu = cpu;
      g_caller_cpu.store(cpu, std::memory_order_relaxed);
    }
    // A host thread's kernel while a device thread runs one: they must not share a core.
    if (g_workers_in_kernel.load(std::memory_order_relaxed) > 0 &&
        g_moved_workers.load(std::memory_order_relaxed) > 0)
      stop_following();
    return;
  }
  if (g_follow.load(std::memory_order_relaxed)) {
    const int epoch = g_placement_epoch.load(std::memory_order_relaxed);
    if (p.epoch != epoch) {
      p.epoch = epoch;
      p.cpu = -1;
    }
    // Moved there before and still there (its affinity may have been changed since).
    const int target = g_caller_cpu.load(std::memory_order_relaxed);
    if (target >= 0 && p.cpu != -2 - target && (target != p.cpu || target != sched_getcpu()))
      move_to(target);  // sets p.cpu
    else if (target < 0 && p.cpu >= 0)
      unmove_self();
    if (target >= 0 && p.cpu == target) {
      const int task = torch::autograd::get_current_graph_task_id();
      if (task != p.pin_task) {
        p.pin_task = task;
        const pid_t caller = g_caller_tid.load(std::memory_order_relaxed);
        if (task >= 0 && caller != 0) pin_caller(caller, target);
      }
    }
    // Counted only while following, the one use of the count. Two device threads in kernels at
    // once (a backward over two devices): same rule.
    counted_ = true;
    if (g_workers_in_kernel.fetch_add(1, std::memory_order_relaxed) > 0 &&
        g_moved_workers.load(std::memory_order_relaxed) > 0)
      stop_following();
  }
  if (g_stats.load(std::memory_order_relaxed)) start_ns_ = monotonic_ns();
}

// [docs:end FOLLOW_CALLER]

DeviceThreadPlacement::~DeviceThreadPlacement() {
  --t_place.depth;
  if (counted_) g_workers_in_kernel.fetch_sub(1, std::memory_order_relaxed);
  if (start_ns_ != 0) {
    const int64_t end = monotonic_ns();
    g_stat_kernels.fetch_add(1, std::memory_order_relaxed);
    g_stat_busy.fetch_add(end - start_ns_, std::memory_order_relaxed);
    int64_t zero = 0;
    g_stat_first.compare_exchange_strong(zero, start_ns_, std::memory_order_relaxed);
    g_stat_last.store(end, std::memory_order_relaxed);
  }
}

bool follow_caller_enabled() { return g_follow.load(); }

void set_follow_caller(bool enabled) {
  std::lock_guard lock(g_moved_mutex);
  g_follow.store(enabled);
  if (!enabled) {
    restore_moved_workers_locked();
    release_pinned_caller_locked();
  }
}

DeviceThreadStats device_thread_stats() {
  return {g_stat_kernels.load(), g_stat_busy.load(), g_stat_first.load(), g_stat_last.load(),
          g_stat_moves.load(), g_stat_pins.load()};
}

void reset_device_thread_stats(bool enabled) {
  g_stats.store(false);
  g_stat_kernels.store(0);
  g_stat_busy.store(0);
  g_stat_first.store(0);
  g_stat_last.store(0);
  g_stat_moves.store(0);
  g_stat_pins.store(0);
  g_stats.store(enabled);
}

bool is_autograd_worker_thread() {
  char name[16] = {0};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) return false;
  return std::strncmp(name, "pt_autograd_", 12) == 0;
}

// [docs:start DEVICE_THREAD_SLICE]
// Each device thread asks the scheduler for a short time slice (issue 31). A backward hands its
// work to the device thread and the caller sleeps until it is done: the device thread has to be
// woken, and on a machine with no idle core it waits for one. With the kernel's EEVDF scheduler
// (Linux 6.6 and later) a woken thread waits for the running thread's slice to end (the default
// slice was 1.4 ms here, ended at a tick, 4 ms at HZ=250), unless it asks for a shorter slice than
// the running thread's: then it runs at once (PREEMPT_SHORT, Linux 6.12 and later). Measured
// (docs/autograd.md, "On a busy machine"): beside other processes, backward's handoff took 1-8 ms
// of waiting on the run queue with the default slice, 0.3 ms with 100 us. Its share of the CPU
// is the same (the scheduler stays fair); only when it runs changes. A thread may shorten its own
// slice without privileges (sched_setattr's sched_runtime for SCHED_OTHER); older kernels ignore
// it. OPENREG_AUTOGRAD_SLICE_US=<us> sets another slice (0: the kernel's default). A device
// thread the user made SCHED_BATCH, SCHED_IDLE or real-time is left alone.
namespace {
struct SchedAttr {  // struct sched_attr of <linux/sched/types.h>, its first version (48 bytes)
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;
  uint64_t sched_deadline;
  uint64_t sched_period;
};

int64_t device_thread_slice_ns() {
  int64_t us = 100;  // the shortest slice the kernel accepts
  if (const char* env = std::getenv("OPENREG_AUTOGRAD_SLICE_US")) us = std::atoll(env);
  return us > 0 ? us * 1000 : 0;
}

void shorten_own_slice() {
#if defined(SYS_sched_getattr) && defined(SYS_sched_setattr)
  const int64_t slice = device_thread_slice_ns();
  if (slice == 0) return;
  SchedAttr attr{};
  if (syscall(SYS_sched_getattr, 0, &attr, sizeof attr, 0) != 0) return;
  if (attr.sched_policy != SCHED_OTHER) return;
  attr.size = sizeof attr;
  attr.sched_flags = 0;
  attr.sched_runtime = static_cast<uint64_t>(slice);
  syscall(SYS_sched_setattr, 0, &attr, 0);  // nice and policy unchanged
#endif
}
}  // namespace
// [docs:end DEVICE_THREAD_SLICE]

void note_current_device_set(int device) {
  // A device thread sets its device when it starts, before its first backward.
  thread_local const bool worker = is_autograd_worker_thread() && (shorten_own_slice(), true);
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
