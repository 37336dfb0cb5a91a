// Native because: streams are the simulated device's work queues, executed by runtime worker
// threads; their ordering is checked by the C++ kernel launch path on every operator.
#include "runtime/stream.h"

#include "runtime/device.h"
#include "runtime/memory.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace openreg {

class Stream {
 public:
  Stream(int device, int64_t id) : device_(device), id_(id) {}

  void enqueue(std::function<void()> task) {
    std::lock_guard lock(mutex_);
    if (!worker_started_) {
      worker_started_ = true;
      std::thread([this] { run(); }).detach();  // lives as long as the process
    }
    queue_.push_back(std::move(task));
    pending_.fetch_add(1, std::memory_order_release);
    work_cv_.notify_one();
  }

  bool idle() const {
    return pending_.load(std::memory_order_acquire) == 0 &&
           inline_.load(std::memory_order_acquire) == 0;
  }

  void wait_queue() {
    if (pending_.load(std::memory_order_acquire) == 0) return;
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return pending_.load() == 0; });
  }

  void synchronize() {
    wait_queue();
    while (inline_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    rethrow_async_error();
  }

  void rethrow_async_error() {
    if (!has_error_.load(std::memory_order_acquire)) return;
    std::exception_ptr error;
    {
      std::lock_guard lock(mutex_);
      error = std::exchange(error_, nullptr);
      has_error_ = false;
    }
    if (error) std::rethrow_exception(error);
  }

  int device() const { return device_; }
  int64_t id() const { return id_; }
  std::atomic<int> inline_{0};

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        work_cv_.wait(lock, [&] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        task();
      } catch (...) {
        // Reported at the next synchronize, as asynchronous device errors are.
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
        has_error_ = true;
      }
      task = nullptr;  // release captured tensors before the work counts as done
      std::lock_guard lock(mutex_);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_cv_.notify_all();
    }
  }

  const int device_;
  const int64_t id_;
  std::mutex mutex_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::function<void()>> queue_;
  std::atomic<int64_t> pending_{0};
  bool worker_started_ = false;
  std::exception_ptr error_;
  std::atomic<bool> has_error_{false};
};

namespace {

constexpr int64_t kStreamsPerDevice = 1 + 2 * kPoolSize;

struct DeviceStreams {
  std::vector<std::unique_ptr<Stream>> streams;
  std::atomic<uint32_t> next_normal{0}, next_high{0};
};

std::vector<DeviceStreams>& all_streams() {
  static auto* devices = [] {
    auto* d = new std::vector<DeviceStreams>(device_count());  // leaked on purpose
    for (int dev = 0; dev < device_count(); ++dev)
      for (int64_t id = 0; id < kStreamsPerDevice; ++id)
        (*d)[dev].streams.push_back(std::make_unique<Stream>(dev, id));
    return d;
  }();
  return *devices;
}

constexpr int kMaxDevices = 64;
thread_local int64_t tls_current_stream[kMaxDevices] = {};

}  // namespace

Stream* get_stream(int device, int64_t id) {
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

int stream_priority(int64_t id) { return id > kPoolSize ? kHighestPriority : kLowestPriority; }

int64_t stream_from_pool(int device, int priority) {
  check_device(device);
  auto& d = all_streams()[device];
  if (priority < kLowestPriority)
    return 1 + kPoolSize + (d.next_high.fetch_add(1) % kPoolSize);
  return 1 + (d.next_normal.fetch_add(1) % kPoolSize);
}

void stream_enqueue(Stream* s, std::function<void()> task) {
  check_not_forked();
  s->enqueue(std::move(task));
}

bool stream_query(Stream* s) {
  s->rethrow_async_error();
  return s->idle();
}

void stream_synchronize(Stream* s) { s->synchronize(); }

void device_synchronize(int device) {
  check_device(device);
  for (auto& s : all_streams()[device].streams) s->synchronize();
}

void synchronize_all() {
  for (int d = 0; d < device_count(); ++d) device_synchronize(d);
}

int stream_device(const Stream* s) { return s->device(); }
int64_t stream_id(const Stream* s) { return s->id(); }

LaunchScope::LaunchScope(Stream* s) : stream_(s) {
  s->wait_queue();
  s->inline_.fetch_add(1, std::memory_order_acq_rel);
}

LaunchScope::~LaunchScope() { stream_->inline_.fetch_sub(1, std::memory_order_acq_rel); }

// ---------------------------------------------------------------- events

struct EventState {
  EventState(int d, bool t) : device(d), timing(t) {}
  const int device;
  const bool timing;
  std::mutex mutex;
  std::condition_variable cv;
  uint64_t recorded = 0;   // version of the last record() call
  uint64_t completed = 0;  // version the device has reached
  std::chrono::steady_clock::time_point when;
};

EventPtr event_create(int device, bool enable_timing) {
  check_device(device);
  return std::make_shared<EventState>(device, enable_timing);
}

int event_device(const EventPtr& e) { return e->device; }

namespace {
void complete(const EventPtr& e, uint64_t version) {
  std::lock_guard lock(e->mutex);
  if (version > e->completed) {
    e->completed = version;
    e->when = std::chrono::steady_clock::now();
  }
  e->cv.notify_all();
}
}  // namespace

void event_record(const EventPtr& e, Stream* s) {
  TORCH_CHECK(stream_device(s) == e->device, "openreg: event on device ", e->device,
              " cannot be recorded on a stream of device ", stream_device(s));
  uint64_t version;
  {
    std::lock_guard lock(e->mutex);
    version = ++e->recorded;
  }
  if (s->idle()) {
    complete(e, version);
  } else {
    stream_enqueue(s, [e, version] { complete(e, version); });
  }
}

bool event_query(const EventPtr& e) {
  std::lock_guard lock(e->mutex);
  return e->completed >= e->recorded;
}

void event_synchronize(const EventPtr& e) {
  std::unique_lock lock(e->mutex);
  e->cv.wait(lock, [&] { return e->completed >= e->recorded; });
}

void event_block(const EventPtr& e, Stream* s) {
  uint64_t version;
  {
    std::lock_guard lock(e->mutex);
    if (e->completed >= e->recorded) return;  // nothing outstanding to wait for
    version = e->recorded;
  }
  stream_enqueue(s, [e, version] {
    std::unique_lock lock(e->mutex);
    e->cv.wait(lock, [&] { return e->completed >= version; });
  });
}

double event_elapsed_ms(const EventPtr& start, const EventPtr& end) {
  TORCH_CHECK_VALUE(start->timing && end->timing,
                    "openreg: both events must be created with enable_timing=True to measure "
                    "elapsed time");
  std::lock_guard l1(start->mutex);
  std::unique_lock l2(end->mutex, std::defer_lock);
  if (end.get() != start.get()) l2.lock();
  TORCH_CHECK_VALUE(start->recorded > 0 && end->recorded > 0,
                    "openreg: both events must be recorded before measuring elapsed time");
  TORCH_CHECK(start->completed >= start->recorded && end->completed >= end->recorded,
              "openreg: events have not completed yet; synchronize before elapsed_time");
  return std::chrono::duration<double, std::milli>(end->when - start->when).count();
}

}  // namespace openreg
