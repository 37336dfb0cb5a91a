// Native because: streams are the simulated device's work queues, executed by runtime worker
// threads; their ordering is checked by the C++ kernel launch path on every operator.
#include "runtime/stream.h"

#include "runtime/device.h"
#include "runtime/faults.h"
#include "runtime/memory.h"

#include <c10/util/Exception.h>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace openreg {

namespace {

using Clock = std::chrono::steady_clock;


// The streams the calling thread holds right now: kernels it runs inline, or the task its worker
// runs. Used to make nested launches free and to refuse waits that could never end.
constexpr int kMaxHeld = 8;
// One thread_local (constant-initialized, so no guard): a launch reaches it in one TLS lookup.
struct HeldStreams {
  Stream* streams[kMaxHeld] = {};
  int count = 0;
  bool is_worker = false;  // a stream's worker thread
};
thread_local HeldStreams t_held;

bool held_here(const HeldStreams& h, const Stream* s) {
  for (int i = 0; i < h.count; ++i)
    if (h.streams[i] == s) return true;
  return false;
}
bool held_here(const Stream* s) { return held_here(t_held, s); }

void push_held(HeldStreams& h, Stream* s) {
  TORCH_CHECK(h.count < kMaxHeld, "openreg: too many nested stream launches");
  h.streams[h.count++] = s;
}

void pop_held(HeldStreams& h, Stream* s) {
  for (int i = h.count - 1; i >= 0; --i)
    if (h.streams[i] == s) {
      for (int j = i; j + 1 < h.count; ++j) h.streams[j] = h.streams[j + 1];
      --h.count;
      return;
    }
}

std::string describe(std::exception_ptr error) {
  try {
    std::rethrow_exception(std::move(error));
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

std::once_flag g_atexit_once;

}  // namespace

// [docs:start STREAM_CLASS]
class Stream {
 public:
  Stream(int device, int64_t id) : device_(device), id_(id) {}

  // state_: bit 0 = a kernel or a task of the stream runs; bit 1 = what runs is a kernel of a
  // host thread (LaunchScope); the rest = 4 x queued tasks.
  static constexpr uint32_t kRunning = 1;
  static constexpr uint32_t kHostKernel = 2;
  static constexpr uint32_t kQueued = 4;

  bool idle() const { return state_.load(std::memory_order_acquire) == 0; }

  // Kernel side (LaunchScope): the stream must be completely idle; then it is held.
  void begin_kernel() {
    if (try_begin_kernel()) return;  // the common case: one atomic operation
    std::unique_lock lock(mutex_);
    waiters_.fetch_add(1);
    cv_.wait(lock, [&] { return try_begin_kernel(); });
    waiters_.fetch_sub(1);
  }

  void end_kernel() { finish(kRunning + kHostKernel); }

  // `task` runs on the worker; `after` (optional) runs once the task counts as done, i.e. after
  // the stream's state was updated: an event completed there is never observed before
  // query() of the stream sees the work behind which it was recorded as finished.
  // Returns whether a host thread's kernel held the stream when the task was queued (the task
  // is behind it in stream order).
  bool enqueue(std::function<void()> task, std::function<void()> after = nullptr) {
    std::lock_guard lock(mutex_);
    if (!worker_started_) {
      lazy_init();  // a forked child of a process with workers must know it is a bad fork
      std::call_once(g_atexit_once, [] { std::atexit([] { drain_at_exit(); }); });
      std::thread([this] { run(); }).detach();  // lives as long as the process
      worker_started_ = true;
    }
    queue_.push_back({std::move(task), std::move(after)});
    const uint32_t before = state_.fetch_add(kQueued);
    work_cv_.notify_one();
    return (before & kHostKernel) != 0;
  }

  // Waits until no host thread's kernel holds the stream. Called after queueing a task while
  // one did: no other host kernel can begin before that task ran (the stream is not idle).
  void wait_for_host_kernel() {
    if ((state_.load() & kHostKernel) == 0) return;
    std::unique_lock lock(mutex_);
    waiters_.fetch_add(1);
    cv_.wait(lock, [&] { return (state_.load() & kHostKernel) == 0; });
    waiters_.fetch_sub(1);
  }

  void rethrow_async_error() {
    if (!has_error_.load(std::memory_order_acquire)) return;
    std::string message;
    {
      std::lock_guard lock(mutex_);
      message = std::exchange(error_, std::string());
      has_error_ = false;
    }
    TORCH_CHECK(false, "openreg: asynchronous error on stream ", id_, " of openreg:", device_,
                ": ", message,
                "\n(Work queued on a stream runs later; its errors are reported at the next "
                "synchronize or query of the stream or of its device.)");
  }

  bool has_error() const { return has_error_.load(std::memory_order_acquire); }

  bool worker_started() {
    std::lock_guard lock(mutex_);
    return worker_started_;
  }

  int device() const { return device_; }
  int64_t id() const { return id_; }

  Capture* capture() const { return capture_.load(std::memory_order_acquire); }
  void set_capture(Capture* c) { capture_.store(c, std::memory_order_release); }

 private:
  bool try_begin_kernel() {
    uint32_t idle = 0;
    return state_.compare_exchange_strong(idle, kRunning + kHostKernel);
  }

  // Worker side: queued tasks only wait for the running work to end.
  bool try_begin_task() {
    uint32_t s = state_.load();
    while ((s & kRunning) == 0)
      if (state_.compare_exchange_weak(s, s | kRunning)) return true;
    return false;
  }

  void finish(uint32_t amount) {
    state_.fetch_sub(amount);
    // Sequentially consistent with waiters_.fetch_add in the waits: either a waiter is seen
    // here, or it sees the new state before it sleeps.
    if (waiters_.load() > 0) {
      std::lock_guard lock(mutex_);
      cv_.notify_all();
    }
  }

  void run() {
    t_held.is_worker = true;
    // A thread starts with its starter's name and affinity; a stream's first task may be queued
    // from an autograd device thread ("pt_autograd_<n>", possibly kept on one core while it
    // follows its caller, docs/autograd.md). The worker is a thread of its own.
    pthread_setname_np(pthread_self(), "openreg_stream");
    sched_setaffinity(0, sizeof(cpu_set_t), &process_affinity());
    for (;;) {
      std::function<void()> task, after;
      {
        std::unique_lock lock(mutex_);
        work_cv_.wait(lock, [&] { return !queue_.empty(); });
        waiters_.fetch_add(1);
        cv_.wait(lock, [&] { return try_begin_task(); });
        waiters_.fetch_sub(1);
        task = std::move(queue_.front().task);
        after = std::move(queue_.front().after);
        queue_.pop_front();
      }
      push_held(t_held, this);
      try {
        if (task) task();
        task = nullptr;  // release captured tensors before the work counts as done
      } catch (...) {
        task = nullptr;
        std::string message = describe(std::current_exception());
        std::lock_guard lock(mutex_);
        if (!has_error_) error_ = std::move(message);  // the first error is the one reported
        has_error_ = true;
      }
      pop_held(t_held, this);
      finish(kRunning + kQueued);
      if (after) after();
    }
  }

  struct Item {
    std::function<void()> task;
    std::function<void()> after;
  };

  const int device_;
  const int64_t id_;
  std::atomic<uint32_t> state_{0};
  std::atomic<int> waiters_{0};
  std::mutex mutex_;
  std::condition_variable cv_;       // state_ changed (for waiting kernels and the worker)
  std::condition_variable work_cv_;  // a task was queued (for the idle worker)
  std::deque<Item> queue_;
  bool worker_started_ = false;
  std::string error_;
  std::atomic<bool> has_error_{false};
  std::atomic<Capture*> capture_{nullptr};  // graph capture recording on this stream
};
// [docs:end STREAM_CLASS]

namespace {

// [docs:start COPY_ENGINE]
// One engine per direction per device. A copy holds it for its whole simulated duration; when it
// is released, the waiting copy of the highest-priority stream gets it (then the oldest).
class CopyEngine {
 public:
  void acquire(int priority) {
    std::unique_lock lock(mutex_);
    const std::pair<int, uint64_t> me{priority, next_ticket_++};
    waiting_.insert(me);
    cv_.wait(lock, [&] { return !busy_ && *waiting_.begin() == me; });
    waiting_.erase(me);
    busy_ = true;
  }
  void release() {
    {
      std::lock_guard lock(mutex_);
      busy_ = false;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool busy_ = false;
  uint64_t next_ticket_ = 0;
  std::set<std::pair<int, uint64_t>> waiting_;  // (priority, arrival): begin() goes next
};
// [docs:end COPY_ENGINE]

struct DeviceStreams {
  std::vector<std::unique_ptr<Stream>> streams;
  std::atomic<uint32_t> next[kPriorityLevels] = {};
  CopyEngine to_device, to_host;
};

std::atomic<bool> g_streams_created{false};

std::vector<DeviceStreams>& all_streams() {
  static auto* devices = [] {
    auto* d = new std::vector<DeviceStreams>(device_count());  // leaked on purpose
    for (int dev = 0; dev < device_count(); ++dev)
      for (int64_t id = 0; id < kStreamsPerDevice; ++id)
        (*d)[dev].streams.push_back(std::make_unique<Stream>(dev, id));
    g_streams_created = true;
    return d;
  }();
  return *devices;
}

constexpr int kMaxDevices = 64;
thread_local int64_t tls_current_stream[kMaxDevices] = {};

double env_double(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || value < 0) return fallback;
  return value;
}

std::atomic<double> g_copy_latency_us{env_double("OPENREG_COPY_LATENCY_US", 10.0)};
std::atomic<double> g_copy_bandwidth_gbps{env_double("OPENREG_COPY_BANDWIDTH_GBPS", 0.0)};

// Sleeps for long waits, yields for the last stretch (sleep overshoots by tens of us).
void wait_until(Clock::time_point deadline) {
  for (;;) {
    auto now = Clock::now();
    if (now >= deadline) return;
    auto left = deadline - now;
    if (left > std::chrono::microseconds(150))
      std::this_thread::sleep_for(left - std::chrono::microseconds(80));
    else
      std::this_thread::yield();
  }
}

}  // namespace

Stream* get_stream(int device, int64_t id) {
  check_not_forked();
  check_device(device);
  TORCH_CHECK(id >= 0 && id < kStreamsPerDevice, "openreg: invalid stream id ", id,
              " for device ", device);
  return all_streams()[device].streams[id].get();
}

int64_t current_stream_id(int device) { return tls_current_stream[device]; }

void set_current_stream_id(int device, int64_t id) {
  get_stream(device, id);  // validates
  tls_current_stream[device] = id;
}

int stream_priority(int64_t id) {
  if (id <= 0) return kLowestPriority;
  return -static_cast<int>((id - 1) / kPoolSize);
}

int64_t stream_from_pool(int device, int priority) {
  check_not_forked();
  check_device(device);
  priority = std::min(std::max(priority, kHighestPriority), kLowestPriority);
  const int level = -priority;
  auto& d = all_streams()[device];
  return 1 + level * kPoolSize + (d.next[level].fetch_add(1) % kPoolSize);
}

int stream_device(const Stream* s) { return s->device(); }
int64_t stream_id(const Stream* s) { return s->id(); }

// The host waits for an event, without reporting it to the profiler (defined with events).
void event_wait_host(const EventPtr& e);

// [docs:start PROFILER_TIMING]
namespace {
std::atomic<ActivityRecorder*> g_recorder{nullptr};

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

// What this thread's current outermost launch is, for the recorder.
struct LaunchKind {
  ActivityKind kind = ActivityKind::Kernel;
  size_t bytes = 0;
};
thread_local LaunchKind t_launch_kind;

// A host wait (synchronize) that blocked, reported as it ends.
class HostWaitRecord {
 public:
  HostWaitRecord(const char* name, int device, int64_t stream)
      : recorder_(g_recorder.load(std::memory_order_relaxed)), name_(name), device_(device),
        stream_(stream) {
    if (recorder_ != nullptr) start_ns_ = wall_ns();
  }
  ~HostWaitRecord() {
    if (recorder_ == nullptr || g_recorder.load(std::memory_order_relaxed) != recorder_) return;
    Issuer issuer = recorder_->issuer();
    issuer.start_ns = start_ns_;
    issuer.end_ns = wall_ns();
    recorder_->record({ActivityKind::HostWait, device_, stream_, start_ns_, issuer.end_ns, 0,
                       issuer, name_});
  }

 private:
  ActivityRecorder* recorder_;
  const char* name_;
  int device_;
  int64_t stream_;
  int64_t start_ns_ = 0;
};
}  // namespace

void set_activity_recorder(ActivityRecorder* recorder) { g_recorder.store(recorder); }
ActivityRecorder* activity_recorder() { return g_recorder.load(std::memory_order_relaxed); }
int64_t activity_clock_ns() { return wall_ns(); }

void mark_launch_as(ActivityKind kind, size_t bytes) { t_launch_kind = {kind, bytes}; }
// [docs:end PROFILER_TIMING]

void stream_enqueue(Stream* s, std::function<void()> task) {
  check_not_forked();
  if (Capture* c = s->capture())
    capture_fail(c, "openreg: queueing asynchronous work on a capturing stream is not "
                    "supported (operation not permitted when stream is capturing)");
  s->enqueue(std::move(task));
}

bool stream_query(Stream* s) {
  check_not_forked();
  // Querying the capturing stream itself has no answer (its work has not run); other streams
  // can be queried: a query never makes the host wait.
  if (Capture* c = s->capture())
    capture_fail(c, c10::str("openreg: querying stream ", s->id(), " of openreg:", s->device(),
                             " while it is capturing a graph is not permitted (operation not "
                             "permitted when stream is capturing)"));
  check_device_fault(s->device());
  s->rethrow_async_error();
  return s->idle();
}

void stream_wait(Stream* s) {
  check_not_forked();
  if (s->idle()) return;
  TORCH_CHECK(!held_here(s), "openreg: cannot wait for stream ", s->id(), " of openreg:",
              s->device(), " from work running on that stream (it would never finish)");
  // A marker behind everything issued so far: work issued later does not delay the wait.
  auto marker = event_create(s->device(), false);
  event_record(marker, s);
  event_wait_host(marker);
}

void stream_synchronize(Stream* s) {
  check_capture_permits("synchronizing a stream", s->device(), s);
  if (!s->idle()) {
    HostWaitRecord record("openregStreamSynchronize", s->device(), s->id());
    stream_wait(s);
  }
  check_device_fault(s->device());
  s->rethrow_async_error();
}

void device_synchronize(int device) {
  check_device(device);
  check_not_forked();
  check_capture_permits("synchronizing a device", device, nullptr);
  auto& streams = all_streams()[device].streams;
  std::vector<EventPtr> markers;
  for (auto& s : streams) {
    if (s->idle()) continue;
    TORCH_CHECK(!held_here(s.get()), "openreg: cannot synchronize openreg:", device,
                " from work running on one of its streams (it would never finish)");
    markers.push_back(event_create(device, false));
    event_record(markers.back(), s.get());
  }
  if (!markers.empty()) {
    HostWaitRecord record("openregDeviceSynchronize", device, current_stream(device)->id());
    for (auto& m : markers) event_wait_host(m);
  }
  check_device_fault(device);
  for (auto& s : streams) s->rethrow_async_error();
}

bool on_stream_worker() { return t_held.is_worker; }

void synchronize_all() {
  for (int d = 0; d < device_count(); ++d) device_synchronize(d);
}

void drain_at_exit() noexcept {
  if (in_bad_fork() || !g_streams_created.load()) return;
  try {
    for (auto& d : all_streams())
      for (auto& s : d.streams)
        if (s->worker_started() && !held_here(s.get())) stream_wait(s.get());
  } catch (...) {
    // Exiting anyway: errors of queued work are not reported any more.
  }
}

void stream_inject_error(Stream* s, const std::string& message) {
  stream_enqueue(s, [message] { TORCH_CHECK(false, message); });
}

// [docs:start STREAM_HOLD]
std::shared_ptr<StreamHold> stream_hold(Stream* s, double timeout_s) {
  TORCH_CHECK_VALUE(timeout_s > 0, "openreg: hold timeout must be positive, got ", timeout_s);
  auto hold = std::make_shared<StreamHold>();
  stream_enqueue(s, [hold, timeout_s] {
    std::unique_lock lock(hold->mutex);
    auto timeout = std::chrono::duration<double>(timeout_s);
    if (!hold->cv.wait_for(lock, timeout, [&] { return hold->open; })) hold->expired = true;
  });
  return hold;
}

bool stream_release(const std::shared_ptr<StreamHold>& hold) {
  {
    std::lock_guard lock(hold->mutex);
    hold->open = true;
  }
  hold->cv.notify_all();
  std::lock_guard lock(hold->mutex);
  return !hold->expired;
}
// [docs:end STREAM_HOLD]


// [docs:start ASYNC_KERNEL_QUEUE_IMPL]
namespace {
std::atomic<bool> g_launch_reports_errors{false};
std::atomic<int64_t> g_queued_kernels[kMaxDevices] = {};
}  // namespace

void set_launch_reports_errors(bool on) { g_launch_reports_errors = on; }

bool inside_stream_work() {
  const HeldStreams& h = t_held;
  return h.is_worker || h.count > 0;
}

void stream_enqueue_kernel(Stream* s, std::function<void()> kernel) {
  const int device = s->device();
  g_queued_kernels[device].fetch_add(1);
  struct Done {
    int device;
    ~Done() { g_queued_kernels[device].fetch_sub(1); }
  };
  bool behind_host_kernel;
  try {
    check_not_forked();
    if (Capture* c = s->capture())
      capture_fail(c, "openreg: queueing asynchronous work on a capturing stream is not "
                      "supported (operation not permitted when stream is capturing)");
    on_kernel_launch(device, s->id());  // an injected failure (runtime/faults.h)
    behind_host_kernel = s->enqueue([device, kernel = std::move(kernel)] {
      Done done{device};
      kernel();
    });
  } catch (...) {
    g_queued_kernels[device].fetch_sub(1);
    throw;
  }
  // [docs:start ASYNC_BEHIND_HOST_KERNEL]
  // A kernel that another host thread runs synchronously on the stream (LaunchScope) comes
  // before this one in stream order, but it allocates while it runs: memory the caller frees
  // after this returns (an argument of this kernel, still to be read) would go back to the
  // caching allocator for the stream and could be handed to that earlier kernel, which would
  // overwrite it before this kernel read it. So the launch returns only once that kernel ended,
  // as a synchronous launch waits for it in the default mode.
  if (behind_host_kernel && !held_here(s)) s->wait_for_host_kernel();
  // [docs:end ASYNC_BEHIND_HOST_KERNEL]
}

void wait_for_queued_kernels(int device) {
  if (t_held.is_worker || g_queued_kernels[device].load() == 0) return;
  for (auto& s : all_streams()[device].streams)
    if (!s->idle() && !held_here(s.get())) stream_wait(s.get());
}
// [docs:end ASYNC_KERNEL_QUEUE_IMPL]

// [docs:start LAUNCH_SCOPE_IMPL]
LaunchScope::LaunchScope(Stream* s) : stream_(nullptr) {
  check_not_forked();
  HeldStreams& held = t_held;
  if (held_here(held, s)) return;  // nested launch: the stream is already ours
  // A kernel that reaches here on a capturing stream would run now instead of being recorded.
  if (g_active_captures.load(std::memory_order_relaxed) > 0)
    if (Capture* c = capture_for_launch(s))
      capture_fail(c, "openreg: a kernel without graph-capture support was launched on a "
                      "capturing stream (it would run now instead of at replay); docs/graphs.md "
                      "lists what can be captured");
  const bool profiling = g_recorder.load(std::memory_order_relaxed) != nullptr;
  if (profiling) issue_ns_ = wall_ns();  // the host calls the device
  on_kernel_launch(s->device(), s->id());  // an injected failure (runtime/faults.h)
  s->begin_kernel();
  push_held(held, s);
  stream_ = s;
  if (g_launch_reports_errors.load(std::memory_order_relaxed) && s->has_error()) {
    // Asynchronous kernel mode: the queued work this launch waited for failed (stream.h).
    pop_held(held, s);
    stream_ = nullptr;
    s->end_kernel();
    s->rethrow_async_error();
  }
  if (profiling) {
    t_launch_kind = {};
    start_ns_ = wall_ns();  // the stream is ours from now on: the kernel starts on the device
  }
}

LaunchScope::~LaunchScope() {
  if (stream_ == nullptr) return;
  ActivityRecorder* recorder = g_recorder.load(std::memory_order_relaxed);
  if (recorder != nullptr && start_ns_ != 0) {
    const int64_t end_ns = wall_ns();
    Issuer issuer = recorder->issuer();
    issuer.start_ns = issue_ns_;
    issuer.end_ns = start_ns_;  // the launch: until the stream was free and held for the kernel
    recorder->record({t_launch_kind.kind, stream_->device(), stream_->id(), start_ns_, end_ns,
                      t_launch_kind.bytes, issuer});
  }
  pop_held(t_held, stream_);
  stream_->end_kernel();
}
// [docs:end LAUNCH_SCOPE_IMPL]

// ---------------------------------------------------------------- copy engines

CopyTiming copy_timing() { return {g_copy_latency_us.load(), g_copy_bandwidth_gbps.load()}; }

void set_copy_timing(CopyTiming timing) {
  TORCH_CHECK_VALUE(timing.latency_us >= 0, "copy latency must be >= 0, got ", timing.latency_us);
  TORCH_CHECK_VALUE(timing.bandwidth_gbps >= 0, "copy bandwidth must be >= 0 (0 = unlimited), "
                    "got ", timing.bandwidth_gbps);
  g_copy_latency_us = timing.latency_us;
  g_copy_bandwidth_gbps = timing.bandwidth_gbps;
}

// [docs:start ENQUEUE_COPY]
void enqueue_copy(Stream* s, bool host_to_device, size_t nbytes, std::function<void()> copy) {
  auto& d = all_streams()[s->device()];
  CopyEngine* engine = host_to_device ? &d.to_device : &d.to_host;
  const int priority = stream_priority(s->id());
  ActivityRecorder* recorder = g_recorder.load(std::memory_order_relaxed);
  Issuer issuer;
  if (recorder != nullptr) {
    issuer = recorder->issuer();
    issuer.start_ns = wall_ns();
    issuer.end_ns = issuer.start_ns;  // queueing is the host's whole part
  }
  auto task = [s, engine, priority, nbytes, host_to_device, issuer, copy = std::move(copy)] {
    engine->acquire(priority);
    struct Release {
      CopyEngine* engine;
      ~Release() { engine->release(); }
    } release{engine};
    const int64_t start_ns = wall_ns();  // the engine is ours: the transfer starts
    CopyTiming timing = copy_timing();
    double us = timing.latency_us;
    if (timing.bandwidth_gbps > 0) us += double(nbytes) / (timing.bandwidth_gbps * 1e3);
    // The transfer is in flight for its simulated duration; its data lands at the end.
    wait_until(Clock::now() + std::chrono::nanoseconds(int64_t(us * 1e3)));
    copy();
    if (ActivityRecorder* r = g_recorder.load(std::memory_order_relaxed); r && issuer.start_ns) {
      r->record({host_to_device ? ActivityKind::CopyHtoD : ActivityKind::CopyDtoH, s->device(),
                 s->id(), start_ns, wall_ns(), nbytes, issuer});
    }
  };
  stream_enqueue(s, std::move(task));
}
// [docs:end ENQUEUE_COPY]

// ---------------------------------------------------------------- events

struct EventState {
  EventState(int d, bool t) : device(d), timing(t) {}
  const int device;
  const bool timing;
  std::mutex mutex;
  std::condition_variable cv;
  uint64_t recorded = 0;      // version of the last record() call
  uint64_t completed = 0;     // version the device has reached
  Stream* pending = nullptr;  // stream of the last record while it is not complete
  Clock::time_point when;
  Capture* captured_by = nullptr;  // the last record was recorded into this capture
  CaptureClock capture_clock;      // what the recording stream had seen, at that record
};

EventPtr event_create(int device, bool enable_timing) {
  check_device(device);
  return std::make_shared<EventState>(device, enable_timing);
}

int event_device(const EventPtr& e) { return e->device; }

namespace {
void complete(const EventPtr& e, uint64_t version) {
  {
    std::lock_guard lock(e->mutex);
    if (version > e->completed) {
      e->completed = version;
      e->when = Clock::now();
      if (e->completed >= e->recorded) e->pending = nullptr;
    }
  }
  e->cv.notify_all();
}
}  // namespace

// [docs:start EVENT_RECORD]
void event_record(const EventPtr& e, Stream* s) {
  check_not_forked();
  TORCH_CHECK(stream_device(s) == e->device, "openreg: event on device ", e->device,
              " cannot be recorded on a stream of device ", stream_device(s));
  if (Capture* c = s->capture()) {
    // [docs:start CAPTURE_EVENT_RECORD]
    // Recorded into the graph: the record happens at each replay, on the replaying stream.
    capture_record(c, s->id(), "event record", [e] {
      {
        std::lock_guard lock(e->mutex);
        e->captured_by = nullptr;
      }
      event_record(e, current_stream(e->device));
    });
    CaptureClock seen;
    {
      std::lock_guard lock(c->mutex);
      c->events.push_back(e);
      seen = c->clocks[s->id()];  // everything recorded on s so far, and what s waited for
    }
    std::lock_guard lock(e->mutex);
    e->captured_by = c;
    e->capture_clock = std::move(seen);
    return;
    // [docs:end CAPTURE_EVENT_RECORD]
  }
  uint64_t version;
  {
    std::lock_guard lock(e->mutex);
    version = ++e->recorded;
    e->pending = s;
    e->captured_by = nullptr;
  }
  // A record issued from work running on the stream itself (the allocator freeing a block
  // inside a kernel) covers the work before that kernel: complete it now.
  if (s->idle() || held_here(s)) {
    complete(e, version);
  } else {
    // The event completes after the stream's state counts everything before it as done.
    check_not_forked();
    s->enqueue(nullptr, [e, version] { complete(e, version); });
  }
}
// [docs:end EVENT_RECORD]

bool event_query(const EventPtr& e) {
  std::lock_guard lock(e->mutex);
  return e->completed >= e->recorded;
}

namespace {
// The host waits for `e`; `record` reports the wait to the profiler as the user's own
// synchronize (the runtime's internal waits are reported by their callers).
void wait_event(const EventPtr& e, bool record) {
  {
    Stream* pending = nullptr;
    Capture* captured = nullptr;
    {
      std::lock_guard lock(e->mutex);
      pending = e->pending;
      captured = e->captured_by;
    }
    if (captured != nullptr)
      capture_fail(captured, "openreg: synchronizing an event recorded during graph capture is "
                             "not permitted (operation not permitted when stream is capturing)");
    if (pending != nullptr) check_capture_permits("synchronizing an event", e->device, pending);
  }
  std::optional<HostWaitRecord> host_wait;
  std::unique_lock lock(e->mutex);
  if (e->completed >= e->recorded) return;
  TORCH_CHECK(!held_here(e->pending), "openreg: cannot wait for an event recorded on stream ",
              e->pending->id(), " of openreg:", e->device,
              " from work running on that stream (it would never finish)");
  if (record) host_wait.emplace("openregEventSynchronize", e->device, e->pending->id());
  e->cv.wait(lock, [&] { return e->completed >= e->recorded; });
}
}  // namespace

void event_synchronize(const EventPtr& e) { wait_event(e, /*record=*/true); }
void event_wait_host(const EventPtr& e) { wait_event(e, /*record=*/false); }

namespace {
void merge(CaptureClock& into, const CaptureClock& from) {
  for (const auto& [id, n] : from) into[id] = std::max(into[id], n);
}

// [docs:start CAPTURE_WAIT]
// `s` waits for event `e` recorded in capture `c`: s joins the capture if it is not in it yet
// (its later work is recorded into the graph, and allocations come from the graph's pool).
void capture_wait(Capture* c, Stream* s, const EventPtr& e) {
  TORCH_CHECK(stream_device(s) == c->device, "openreg: a stream of openreg:", stream_device(s),
              " cannot join a graph captured on openreg:", c->device);
  if (s->id() == 0)
    capture_fail(c, c10::str("openreg: the default stream of openreg:", s->device(), " cannot "
                             "join a graph capture (wait for the event on a side stream)"));
  CaptureClock seen;
  {
    std::lock_guard lock(e->mutex);
    seen = e->capture_clock;
  }
  std::lock_guard lock(c->mutex);
  if (s->capture() == nullptr) {
    s->set_capture(c);
    c->joined.push_back(s);
  }
  merge(c->clocks[s->id()], seen);
}
// [docs:end CAPTURE_WAIT]
}  // namespace

// [docs:start EVENT_BLOCK]
void event_block(const EventPtr& e, Stream* s) {
  uint64_t version;
  Capture* recorded_in = nullptr;
  {
    std::lock_guard lock(e->mutex);
    recorded_in = e->captured_by;
    if (recorded_in == nullptr && e->completed >= e->recorded) return;  // nothing to wait for
    version = e->recorded;
  }
  // [docs:start CAPTURE_EVENT_BLOCK]
  Capture* c = s->capture();
  if (recorded_in != nullptr || c != nullptr) {
    if (recorded_in != nullptr && (c == nullptr || c == recorded_in)) {
      // Fork (s joins the capture) or join (s, already in it, now depends on the event's
      // stream). Replay runs the recorded work in the order it was issued, which respects
      // every such dependency; what is tracked is only whether each forked stream was
      // joined back into the origin stream before capture_end.
      capture_wait(recorded_in, s, e);
      return;
    }
    if (recorded_in != nullptr)
      capture_fail(recorded_in, c10::str("openreg: stream ", s->id(), " of openreg:",
                                         s->device(), " is capturing another graph and cannot "
                                         "wait for an event recorded in this one"));
    capture_fail(c, "openreg: a capturing stream cannot wait for an event recorded outside the "
                    "capture that has not completed (synchronize before capture_begin)");
  }
  // [docs:end CAPTURE_EVENT_BLOCK]
  // The stream's worker waits: work issued on `s` after this waits behind it, the host does not.
  stream_enqueue(s, [e, version] {
    std::unique_lock lock(e->mutex);
    e->cv.wait(lock, [&] { return e->completed >= version; });
  });
}
// [docs:end EVENT_BLOCK]

double event_elapsed_ms(const EventPtr& start, const EventPtr& end) {
  TORCH_CHECK_VALUE(start->timing && end->timing,
                    "openreg: both events must be created with enable_timing=True to measure "
                    "elapsed time");
  std::unique_lock l1(start->mutex, std::defer_lock);
  std::unique_lock l2(end->mutex, std::defer_lock);
  if (end.get() != start.get()) std::lock(l1, l2);
  else l1.lock();
  TORCH_CHECK_VALUE(start->recorded > 0 && end->recorded > 0,
                    "openreg: both events must be recorded before measuring elapsed time");
  TORCH_CHECK(start->completed >= start->recorded && end->completed >= end->recorded,
              "openreg: events have not completed yet; synchronize before elapsed_time");
  return std::chrono::duration<double, std::milli>(end->when - start->when).count();
}

// ---------------------------------------------------------------- graph capture

std::atomic<int> g_active_captures{0};

namespace {
std::mutex g_capture_mutex;           // guards g_captures
std::vector<Capture*> g_captures;     // running captures

const char* mode_name(CaptureMode m) {
  switch (m) {
    case CaptureMode::Global: return "global";
    case CaptureMode::ThreadLocal: return "thread_local";
    default: return "relaxed";
  }
}

// The running capture that forbids an unsafe call made now by this thread, if any.
Capture* forbidding_capture() {
  std::lock_guard lock(g_capture_mutex);
  for (Capture* c : g_captures) {
    if (c->mode == CaptureMode::Global) return c;
    if (c->mode == CaptureMode::ThreadLocal && c->thread == std::this_thread::get_id()) return c;
  }
  return nullptr;
}
}  // namespace

// [docs:start CAPTURE_BEGIN_END]
void capture_begin(Stream* s, Capture* c) {
  TORCH_CHECK(s->id() != 0, "openreg: graph capture on the default stream of openreg:",
              s->device(), " is not allowed; capture on a side stream "
              "(with torch.Stream(), graph: ...)");
  TORCH_CHECK(s->capture() == nullptr, "openreg: stream ", s->id(), " of openreg:", s->device(),
              " is already capturing a graph");
  stream_synchronize(s);  // the graph starts from an idle stream
  c->device = s->device();
  c->stream_id = s->id();
  c->thread = std::this_thread::get_id();
  c->work.clear();
  c->invalidated.clear();
  c->joined.clear();
  c->clocks.clear();
  {
    std::lock_guard lock(g_capture_mutex);
    g_captures.push_back(c);
  }
  s->set_capture(c);
  g_active_captures.fetch_add(1);
}

void capture_end(Stream* s, Capture* c) {
  TORCH_CHECK(s->capture() == c, "openreg: capture_end on stream ", s->id(), " of openreg:",
              s->device(), ", which is not capturing this graph (end the capture on the stream "
              "and device where it began)");
  // [docs:start CAPTURE_UNJOINED]
  // Every stream that forked from the capture must have been joined back: the origin stream
  // must have waited (directly or through other streams) for its last recorded work.
  std::string unjoined;
  {
    std::lock_guard lock(c->mutex);
    const CaptureClock& origin = c->clocks[s->id()];
    for (Stream* joined : c->joined) {
      const auto own = c->clocks[joined->id()].find(joined->id());
      const uint64_t recorded = own == c->clocks[joined->id()].end() ? 0 : own->second;
      const auto seen = origin.find(joined->id());
      if (recorded > (seen == origin.end() ? 0 : seen->second))
        unjoined += c10::str(unjoined.empty() ? "" : ", ", joined->id());
      joined->set_capture(nullptr);
    }
    c->joined.clear();
    if (!unjoined.empty() && c->invalidated.empty())
      c->invalidated = c10::str(
          "work recorded on stream(s) ", unjoined, " of openreg:", c->device, " was not joined "
          "back into the capturing stream ", s->id(), " before capture_end (record an event on "
          "each of them and make the capturing stream wait for it; operation not permitted: "
          "capture unjoined)");
  }
  // [docs:end CAPTURE_UNJOINED]
  s->set_capture(nullptr);
  {
    std::lock_guard lock(g_capture_mutex);
    g_captures.erase(std::find(g_captures.begin(), g_captures.end(), c));
  }
  g_active_captures.fetch_sub(1);
  // Events recorded into the capture stop pointing at it (the graph may be destroyed first).
  for (auto& weak : c->events)
    if (EventPtr e = weak.lock()) {
      std::lock_guard lock(e->mutex);
      if (e->captured_by == c) e->captured_by = nullptr;
    }
  c->events.clear();
  TORCH_CHECK(c->invalidated.empty(), "openreg: graph capture was invalidated: ", c->invalidated,
              " (the graph cannot be replayed; reset() it and capture again)");
}
// [docs:end CAPTURE_BEGIN_END]

Capture* stream_capture(const Stream* s) { return s->capture(); }

Capture* capture_for_launch(Stream* s) {
  if (Capture* c = s->capture()) return c;
  if (s->id() == 0) {
    // [docs:start CAPTURE_DEFAULT_STREAM]
    if (Capture* c = forbidding_capture())
      capture_fail(c, c10::str("openreg: work on the default stream of openreg:", s->device(),
                               " while a graph is being captured in ", mode_name(c->mode),
                               " mode (operation not permitted when stream is capturing; use a "
                               "side stream, or capture_error_mode=\"relaxed\")"));
    // [docs:end CAPTURE_DEFAULT_STREAM]
  }
  return nullptr;
}

void capture_record(Capture* c, std::string what, std::function<void()> run) {
  capture_record(c, current_stream_id(c->device), std::move(what), std::move(run));
}

void capture_record(Capture* c, int64_t stream_id, std::string what, std::function<void()> run) {
  std::lock_guard lock(c->mutex);
  if (stream_id != c->stream_id) what += c10::str("  [stream ", stream_id, "]");
  c->work.push_back({std::move(what), std::move(run)});
  auto& clock = c->clocks[stream_id];
  ++clock[stream_id];
}

[[noreturn]] void capture_fail(Capture* c, const std::string& message) {
  {
    std::lock_guard lock(c->mutex);
    if (c->invalidated.empty()) c->invalidated = message;
  }
  TORCH_CHECK(false, message);
}

// [docs:start CAPTURE_PERMITS]
void check_capture_permits(const char* what, int device, const Stream* s) {
  if (g_active_captures.load(std::memory_order_relaxed) == 0) return;
  Capture* conflict = nullptr;
  {
    std::lock_guard lock(g_capture_mutex);
    for (Capture* c : g_captures)
      if (c->device == device && (s == nullptr || c->stream_id == s->id())) conflict = c;
  }
  if (s != nullptr && s->capture() != nullptr) conflict = s->capture();  // a forked stream
  if (conflict != nullptr)  // waiting for the capturing stream itself: never possible
    capture_fail(conflict, c10::str("openreg: ", what, " is not permitted while stream ",
                                    s != nullptr ? s->id() : conflict->stream_id, " of openreg:", device, " is capturing a "
                                    "graph (operation not permitted when stream is capturing)"));
  if (Capture* c = forbidding_capture())
    capture_fail(c, c10::str("openreg: ", what, " is not permitted while a graph is being "
                             "captured in ", mode_name(c->mode), " mode (operation not permitted "
                             "when stream is capturing; capture_error_mode=\"relaxed\" allows "
                             "it on other streams)"));
}
// [docs:end CAPTURE_PERMITS]

}  // namespace openreg
