// Native because: streams are the simulated device's work queues, each executed by a runtime
// worker thread; the DeviceGuard, the allocator and every kernel launch consult them from C++.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

namespace openreg {

// Stream ids, per device: 0 is the default stream, then kPoolSize streams of priority 0
// (normal) and kPoolSize of priority -1 (high). Lower number = higher priority, as in CUDA.
constexpr int64_t kPoolSize = 8;
constexpr int kHighestPriority = -1;
constexpr int kLowestPriority = 0;

class Stream;

Stream* get_stream(int device, int64_t id);  // checks device and id
int64_t current_stream_id(int device);        // per thread, starts at the default stream
void set_current_stream_id(int device, int64_t id);
int64_t stream_from_pool(int device, int priority);  // round robin within the priority's pool
int stream_priority(int64_t id);
inline Stream* current_stream(int device) { return get_stream(device, current_stream_id(device)); }

// Asynchronous work: runs on the stream's worker thread, after everything enqueued before it.
void stream_enqueue(Stream* s, std::function<void()> task);
// True when every asynchronous task enqueued so far has run.
bool stream_query(Stream* s);
// Blocks the host until the stream's queued work has run; raises an error a task raised.
void stream_synchronize(Stream* s);
void device_synchronize(int device);
void synchronize_all();

// Kernels run on the calling thread, in stream order: a LaunchScope waits until the stream's
// queue is empty before the kernel runs and keeps the stream busy (query() false) until it ends.
class LaunchScope {
 public:
  explicit LaunchScope(Stream* s);
  ~LaunchScope();
  LaunchScope(const LaunchScope&) = delete;
  LaunchScope& operator=(const LaunchScope&) = delete;

 private:
  Stream* stream_;
};

// Events.
struct EventState;
using EventPtr = std::shared_ptr<EventState>;
EventPtr event_create(int device, bool enable_timing);
int event_device(const EventPtr& e);
void event_record(const EventPtr& e, Stream* s);
bool event_query(const EventPtr& e);
void event_synchronize(const EventPtr& e);
void event_block(const EventPtr& e, Stream* s);  // the stream waits for the event's last record
double event_elapsed_ms(const EventPtr& start, const EventPtr& end);

int stream_device(const Stream* s);
int64_t stream_id(const Stream* s);

}  // namespace openreg
