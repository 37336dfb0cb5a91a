// Native because: streams are the simulated device's work queues, each executed by a runtime
// worker thread; the DeviceGuard, the allocator and every kernel launch consult them from C++.
//
// The execution model (docs/streams.md):
//   * A stream is an ordered sequence of work. Two kinds of work go on it:
//       - kernels (every operator, synchronous copies): they run *inline* on the thread that issues
//         them, inside a LaunchScope, because handing each operator to another thread would cost
//         more than the whole per-operator budget;
//       - asynchronous work (non_blocking copies with pinned memory, event records and waits,
//         markers): it is queued and run by the stream's worker thread, started on first use.
//   * At most one piece of work of a stream runs at a time, in issue order: a kernel starts when
//     the stream's queue is empty and nothing else of the stream runs; the worker starts a queued
//     task when no kernel of the stream runs. Different streams run concurrently.
//   * Asynchronous copies go through simulated copy engines (one per direction per device) with
//     a configurable latency and bandwidth; when several streams wait for an engine, the
//     highest-priority stream gets it first. That is what a stream's priority changes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace openreg {

// Stream ids, per device: 0 is the default stream, then kPoolSize streams for each priority
// level. Priorities follow CUDA: lower number = higher priority; 0 is the lowest (the default)
// and kHighestPriority the highest. Out-of-range priorities are clamped, as on CUDA.
constexpr int64_t kPoolSize = 8;
constexpr int kPriorityLevels = 4;
constexpr int kLowestPriority = 0;
constexpr int kHighestPriority = -(kPriorityLevels - 1);
constexpr int64_t kStreamsPerDevice = 1 + kPriorityLevels * kPoolSize;

class Stream;
struct EventState;

Stream* get_stream(int device, int64_t id);  // checks device and id
int64_t current_stream_id(int device);        // per thread, starts at the default stream
void set_current_stream_id(int device, int64_t id);
int64_t stream_from_pool(int device, int priority);  // round robin within the priority's pool
int stream_priority(int64_t id);
inline Stream* current_stream(int device) { return get_stream(device, current_stream_id(device)); }
int stream_device(const Stream* s);
int64_t stream_id(const Stream* s);

// Asynchronous work: runs on the stream's worker thread, after everything issued on the stream
// before it. An exception it throws is reported by the next query or synchronize of the stream
// (or of its device), as a real device reports asynchronous errors.
void stream_enqueue(Stream* s, std::function<void()> task);
// True when all the work issued on the stream so far has run; raises a pending async error.
bool stream_query(Stream* s);
// Blocks the host until the work issued on the stream before the call has run; raises a
// pending asynchronous error of the stream.
void stream_synchronize(Stream* s);
// The same wait without reporting errors: used to order a copy after another stream's work.
void stream_wait(Stream* s);
void device_synchronize(int device);
void synchronize_all();
// True on a stream's worker thread (which must never wait for the GIL).
bool on_stream_worker();
// At interpreter exit: runs the queued work of every stream (so that no worker touches memory or
// objects being destroyed), without raising. Does nothing in a forked child.
void drain_at_exit() noexcept;

// [docs:start ASYNC_KERNEL_QUEUE]
// Kernels queued by the asynchronous kernel mode (ops/async_kernel.cpp, docs/async_mode.md). They
// work on device memory they do not own, as a GPU kernel does: memory the host frees meanwhile
// goes back to the caching allocator at once and is reused in stream order, but must not go back
// to the driver before they ran. stream_enqueue_kernel counts them per device;
// wait_for_queued_kernels (called by the allocator before it releases segments, as cudaFree
// synchronizes the device) waits until the device has none left, except on streams the calling
// thread holds (their queue was empty when it took them).
void stream_enqueue_kernel(Stream* s, std::function<void()> kernel);
void wait_for_queued_kernels(int device);
// True on a stream worker or while the thread holds a stream (inside a LaunchScope): work issued
// now must run inline, since queueing it behind the held stream's current work would never let
// the caller see its result.
bool inside_stream_work();
// While on, a kernel launched synchronously (LaunchScope: .item(), .cpu(), blocking copies) on a
// stream whose queued work failed reports that error, after waiting for the queue, as a GPU
// reports a sticky asynchronous error at the next synchronizing call. Set by the async mode.
void set_launch_reports_errors(bool on);
// [docs:end ASYNC_KERNEL_QUEUE]

// A testing aid: queues a task that fails with `message`, to test how code handles an
// asynchronous device error (it surfaces at the next synchronize or query).
void stream_inject_error(Stream* s, const std::string& message);

// A testing aid: a gate queued on a stream. The stream's worker stops at it, so everything queued
// on the stream after it stays pending, until stream_release() opens it (or `timeout_s` passes,
// so a mistake cannot hang the process). Makes "the copy has not landed yet" deterministic
// instead of depending on a simulated latency and on how fast the host thread is scheduled.
struct StreamHold {
  std::mutex mutex;
  std::condition_variable cv;
  bool open = false;
  bool expired = false;
};
std::shared_ptr<StreamHold> stream_hold(Stream* s, double timeout_s);
// Opens the gate; returns false if it had already opened by itself after the timeout.
bool stream_release(const std::shared_ptr<StreamHold>& hold);

// [docs:start LAUNCH_SCOPE]
// Kernels run on the calling thread, in stream order: a LaunchScope waits until the stream's
// queue is empty and no other work of the stream runs, then holds the stream (query() is false,
// queued tasks and other threads' kernels wait) until it ends. Nested scopes on a stream the
// thread already holds are free.
class LaunchScope {
 public:
  explicit LaunchScope(Stream* s);
  ~LaunchScope();
  LaunchScope(const LaunchScope&) = delete;
  LaunchScope& operator=(const LaunchScope&) = delete;

 private:
  Stream* stream_;  // nullptr when nested
  int64_t issue_ns_ = 0;  // when the host called it (profiling only)
  int64_t start_ns_ = 0;  // when the stream started running it (profiling only)
};
// [docs:end LAUNCH_SCOPE]

// [docs:start ACTIVITY_RECORDER]
// The profiler's view of the device (docs/profiler.md, csrc/adapters/profiler.cpp). While a
// recorder is installed, the runtime reports every piece of device work with the interval during
// which the device ran it, measured here: a kernel (an outermost LaunchScope) from the moment its
// stream was free and held for it to the moment it released it; an asynchronous copy from the
// moment its copy engine took it to the moment its data landed; a collective from the moment
// it was issued to the moment its result was complete. Each also carries the host side that
// issued it: the calling thread and the interval of the call. The host's waits for the device
// (synchronize calls that blocked) are reported too, as host activity only.
enum class ActivityKind : uint8_t {
  Kernel,
  CopyHtoD,
  CopyDtoH,
  CopyDtoD,
  Memset,
  Collective,  // a collective of the occl process group
  GraphReplay, // a captured graph's kernels, replayed in one launch
  HostWait,    // the host blocked in a synchronize call (no device work)
};
struct Issuer {
  uint64_t correlation = 0;  // the profiler's id of the CPU op that issued the work, 0 if none
  int32_t thread = 0;        // system id of the issuing thread
  int64_t start_ns = 0;      // the host-side call that issued it (for a kernel: the launch,
  int64_t end_ns = 0;        // until its stream was free; the kernel then runs on this thread)
};
struct DeviceActivity {
  ActivityKind kind;
  int device;
  int64_t stream;       // stream id on the device
  int64_t start_ns;     // wall clock (CLOCK_REALTIME, ns), as the profiler's CPU events
  int64_t end_ns;
  size_t bytes;         // copies, memsets and collectives
  Issuer issuer;
  std::string name;     // collectives: the operation; host waits: the runtime call
};
class ActivityRecorder {
 public:
  virtual ~ActivityRecorder() = default;
  // Called on the thread that issues the work, when it is issued: who issues it.
  virtual Issuer issuer() = 0;
  // Called when the work has run (on the issuing thread or on the stream's worker).
  virtual void record(const DeviceActivity& activity) = 0;
};
// nullptr turns recording off. The recorder must stay alive as long as the process.
void set_activity_recorder(ActivityRecorder* recorder);
ActivityRecorder* activity_recorder();  // nullptr unless a profiler session records
// Inside a LaunchScope: reports this thread's current launch as a copy or memset of `bytes`.
void mark_launch_as(ActivityKind kind, size_t bytes);
// The clock of the activities.
int64_t activity_clock_ns();
// [docs:end ACTIVITY_RECORDER]

// Simulated copy engines, used by asynchronous (non_blocking) copies between pinned host memory
// and a device. A copy occupies its device's engine for that direction for
// latency + bytes / bandwidth, and its data lands at the end of that time.
// Set at startup by OPENREG_COPY_LATENCY_US (default 10) and OPENREG_COPY_BANDWIDTH_GBPS
// (default 0 = as fast as the host copies memory).
struct CopyTiming {
  double latency_us;
  double bandwidth_gbps;
};
CopyTiming copy_timing();
void set_copy_timing(CopyTiming timing);
// Queues `copy` on `s` as an asynchronous copy of `nbytes` in the given direction.
void enqueue_copy(Stream* s, bool host_to_device, size_t nbytes, std::function<void()> copy);

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

// ---------------------------------------------------------------- graph capture
// [docs:start CAPTURE_API]
// A stream in capture mode records the work issued on it instead of running it
// (adapters/graph.cpp records kernels and copies; docs/graphs.md). `mode` follows
// torch.accelerator.Graph's capture_error_mode: which unsafe calls (synchronize, blocking
// copies to the host, .item(), the default stream) are refused while the capture runs.
enum class CaptureMode { Global, ThreadLocal, Relaxed };

struct CapturedWork {
  std::string what;             // a readable line for debug_dump
  std::function<void()> run;    // re-executes the work (on the replaying thread, in order)
};

// Which work of each stream of a capture a stream (or an event) has seen: stream id -> number of
// work items recorded on that stream (a vector clock over the capture's streams).
using CaptureClock = std::map<int64_t, uint64_t>;

struct Capture {
  int device = 0;
  int64_t stream_id = 0;  // the origin stream: where capture began and must end
  CaptureMode mode = CaptureMode::Global;
  int64_t pool_key = 0;  // allocator key of the graph's private memory pool
  std::thread::id thread;
  std::vector<CapturedWork> work;
  std::string invalidated;  // set by the first refused operation: capture_end then raises
  std::mutex mutex;         // work may be recorded by an autograd thread on the stream
  std::vector<std::weak_ptr<EventState>> events;  // recorded into the capture
  // Fork/join: other streams of the device join the capture by waiting for an event recorded in
  // it, and must be joined back into the origin stream before capture_end (as on CUDA).
  std::vector<Stream*> joined;
  std::map<int64_t, CaptureClock> clocks;  // per stream in the capture: what it has seen
};

// Starts/ends recording on `s`. capture_begin refuses the default stream and a stream that is
// already capturing; capture_end raises if the capture was invalidated.
void capture_begin(Stream* s, Capture* capture);
void capture_end(Stream* s, Capture* capture);
// The capture recording on `s`, or nullptr. One relaxed atomic load when nothing captures.
Capture* stream_capture(const Stream* s);
// The capture a kernel launched now on `s` must be recorded into, or nullptr to run it. Refuses
// (raises) a launch on the default stream while a global-mode capture runs (CUDA's legacy
// default stream would synchronize with the capturing stream).
Capture* capture_for_launch(Stream* s);
extern std::atomic<int> g_active_captures;
inline Capture* capturing(int device) {
  if (g_active_captures.load(std::memory_order_relaxed) == 0) return nullptr;
  return capture_for_launch(current_stream(device));
}
// Appends work to a capture (the thread issuing it must be the one whose current stream
// captures, or an autograd thread running on that stream).
void capture_record(Capture* capture, std::string what, std::function<void()> run);
// The same, for work issued on stream `stream_id` of the capture's device.
void capture_record(Capture* capture, int64_t stream_id, std::string what,
                    std::function<void()> run);
// Raises a clear error (and invalidates the capture it conflicts with) when `what`, an
// operation that makes the host wait for stream `s` of `device` (s may be nullptr: any/all
// streams of the device), is not permitted under a capture running now.
void check_capture_permits(const char* what, int device, const Stream* s);
// Invalidates `capture` with `message` and raises it.
[[noreturn]] void capture_fail(Capture* capture, const std::string& message);
// [docs:end CAPTURE_API]

}  // namespace openreg
