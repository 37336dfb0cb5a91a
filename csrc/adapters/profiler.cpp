// Native because: PyTorch's profiler (Kineto) accepts a device's activities only from a C++
// libkineto::IActivityProfiler registered through torch::profiler::impl::PrivateUse1ProfilerRegistry.
//
// How the device side reaches torch.profiler (docs/profiler.md):
//   * torch.profiler.profile(activities=[..., ProfilerActivity.PrivateUse1]) (and
//     torch.autograd.profiler.profile(use_device="openreg"), which adds that activity) asks Kineto
//     for the device activity types (kernels, memcpy, ...). Kineto configures every registered
//     plugin; ours returns a session when one of its types is asked for.
//   * While the session records, the runtime (runtime/stream.cpp, ActivityRecorder) reports each
//     kernel launch and each copy with its device, stream and the device-side interval it measured.
//     Torch pushes the correlation id of every CPU op it records (pushCorrelationId, on the op's
//     thread); the recorder stamps device work with the id on top of the issuing thread's stack.
//   * When the trace is processed, the session turns each record into a Kineto activity linked
//     to the CPU op with that id: torch attaches it to that op (device time in key_averages) and
//     export_chrome_trace puts it on the row of its device (pid) and stream (tid).
// libtorch does not export fmt's out-of-line functions, which Kineto's inline headers use.
#define FMT_HEADER_ONLY 1
#define USE_KINETO 1  // the header below is empty without it; libtorch_cpu is built with Kineto

#include "runtime/device.h"
#include "runtime/stream.h"

#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#include <torch/csrc/profiler/stubs/base.h>
#include <c10/util/ApproximateClock.h>
#include <IActivityProfiler.h>
#include <ThreadUtil.h>
#include <libkineto.h>
#include <output_base.h>

#include <fmt/format.h>

#include <map>
#include <mutex>
#include <set>
#include <vector>

namespace openreg {
namespace {

using libkineto::ActivityType;

// [docs:start RECORDER]
// The one recorder of the process: the runtime calls it while a session records.
class Recorder final : public ActivityRecorder {
 public:
  Issuer issuer() override {
    auto& stack = correlation_stack();
    Issuer i;
    i.correlation = stack.empty() ? 0 : stack.back();
    i.thread = libkineto::systemThreadId();
    return i;
  }
  void record(const DeviceActivity& activity) override {
    if (activity.kind == ActivityKind::HostWait && in_end_) return;  // end()'s own wait
    std::lock_guard lock(mutex_);
    records_.push_back(activity);
  }

  static std::vector<uint64_t>& correlation_stack() {
    thread_local std::vector<uint64_t> stack;
    return stack;
  }
  void begin() {
    {
      std::lock_guard lock(mutex_);
      records_.clear();
    }
    set_activity_recorder(this);
  }
  // Device work issued before the end still belongs to the trace: let it finish, then stop.
  // The profiler's own waits for the device are not the program's: not recorded.
  static void synchronize_unrecorded() {
    in_end_ = true;
    try {
      synchronize_all();
    } catch (...) {
      in_end_ = false;
      throw;
    }
    in_end_ = false;
  }
  std::vector<DeviceActivity> end() {
    try {
      synchronize_unrecorded();
    } catch (...) {
      // an asynchronous device error is reported to the user by their next synchronize
    }
    set_activity_recorder(nullptr);
    std::lock_guard lock(mutex_);
    return std::move(records_);
  }

 private:
  std::mutex mutex_;
  std::vector<DeviceActivity> records_;
  static thread_local bool in_end_;
};
thread_local bool Recorder::in_end_ = false;

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: kernels may run during exit
  return *r;
}
// [docs:end RECORDER]

// [docs:start DESCRIBE]
// How each kind of device work shows in the trace: its Kineto type and name on the device's
// stream row, and the name of the host-side runtime call that issued it (CUDA's trace shows
// cudaLaunchKernel, cudaMemcpyAsync, ... in the same place).
struct Description {
  ActivityType type;
  std::string name;
  const char* host_call;  // nullptr: the activity is itself on the host
};

Description describe(const DeviceActivity& a, const libkineto::ITraceActivity* op) {
  const std::string op_name = op != nullptr ? op->name() : std::string("openreg kernel");
  switch (a.kind) {
    case ActivityKind::Kernel:
      return {ActivityType::CONCURRENT_KERNEL, op_name + " (openreg kernel)", "openregLaunchKernel"};
    case ActivityKind::CopyHtoD:
      return {ActivityType::GPU_MEMCPY, "Memcpy HtoD (Host -> openreg)", "openregMemcpy"};
    case ActivityKind::CopyDtoH:
      return {ActivityType::GPU_MEMCPY, "Memcpy DtoH (openreg -> Host)", "openregMemcpy"};
    case ActivityKind::CopyDtoD:
      return {ActivityType::GPU_MEMCPY, "Memcpy DtoD (openreg -> openreg)", "openregMemcpy"};
    case ActivityKind::Memset:
      return {ActivityType::GPU_MEMSET, "Memset (openreg)", "openregMemset"};
    case ActivityKind::Collective:
      return {ActivityType::CONCURRENT_KERNEL, a.name + " (openreg collective)", "occlCollective"};
    case ActivityKind::GraphReplay:
      return {ActivityType::CONCURRENT_KERNEL, "Graph replay (openreg)", "openregGraphLaunch"};
    case ActivityKind::HostWait:  // host activity only: torch asks no sync type of PrivateUse1
      return {ActivityType::PRIVATEUSE1_RUNTIME, a.name, nullptr};
  }
  return {ActivityType::CONCURRENT_KERNEL, op_name, "openregLaunchKernel"};
}
// [docs:end DESCRIBE]

// [docs:start SESSION]
class Session final : public libkineto::IActivityProfilerSession {
 public:
  explicit Session(const std::set<ActivityType>& types) : types_(types) {}
  ~Session() override {
    if (recording_) recorder().end();
  }

  void start() override {
    recorder().begin();
    recording_ = true;
    status_ = libkineto::TraceStatus::RECORDING;
  }
  void stop() override {
    if (recording_) records_ = recorder().end();
    recording_ = false;
    status_ = libkineto::TraceStatus::PROCESSING;
  }
  std::vector<std::string> errors() override { return {}; }

  void pushCorrelationId(uint64_t id) override { Recorder::correlation_stack().push_back(id); }
  void popCorrelationId() override {
    auto& stack = Recorder::correlation_stack();
    if (!stack.empty()) stack.pop_back();
  }

  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, [](int32_t) -> const libkineto::ITraceActivity* { return nullptr; }, 0,
                 0);
  }
  void processTrace(libkineto::ActivityLogger& logger,
                    libkineto::getLinkedActivityCallback linked_activity, int64_t start_time,
                    int64_t end_time) override {
    std::map<int, std::set<int64_t>> streams;  // per device
    for (const DeviceActivity& a : records_) {
      const libkineto::ITraceActivity* op =
          a.issuer.correlation != 0 ? linked_activity(int32_t(a.issuer.correlation)) : nullptr;
      const Description d = describe(a, op);
      if (types_.count(d.type) == 0) continue;
      if (d.host_call == nullptr) {  // a host wait, on the waiting thread's row
        auto& wait = add(d.type, d.name, a.issuer.start_ns, a.issuer.end_ns,
                         libkineto::processId(), a.issuer.thread, op);
        wait.addMetadata("device", a.device);
        wait.addMetadata("stream", a.stream);
        logger.handleGenericActivity(wait);
        continue;
      }
      const int32_t flow = int32_t(++next_id_);
      // The device side: on the row of its device (pid) and stream (tid).
      auto& act = add(d.type, d.name, a.start_ns, a.end_ns, a.device, a.stream, op);
      act.addMetadata("device", a.device);
      act.addMetadata("stream", a.stream);
      act.addMetadata("correlation", a.issuer.correlation);
      if (a.bytes != 0 || a.kind == ActivityKind::CopyHtoD || a.kind == ActivityKind::CopyDtoH ||
          a.kind == ActivityKind::CopyDtoD) {
        act.addMetadata("bytes", a.bytes);
        const double ns = double(std::max<int64_t>(a.end_ns - a.start_ns, 1));
        act.addMetadata("memory bandwidth (GB/s)", fmt::format("{:.3f}", double(a.bytes) / ns));
      }
      // The host side: the runtime call on the issuing thread's row, with a flow arrow from it
      // to the device work (Kineto's CPU-to-GPU link, drawn by trace viewers).
      if (types_.count(ActivityType::PRIVATEUSE1_RUNTIME) != 0 && a.issuer.start_ns != 0) {
        auto& call = add(ActivityType::PRIVATEUSE1_RUNTIME, d.host_call, a.issuer.start_ns,
                         a.issuer.end_ns, libkineto::processId(), a.issuer.thread, op);
        call.threadId = a.issuer.thread;
        call.addMetadata("correlation", a.issuer.correlation);
        call.flow.id = flow;
        call.flow.type = libkineto::kLinkAsyncCpuGpu;
        call.flow.start = true;
        act.flow.id = flow;
        act.flow.type = libkineto::kLinkAsyncCpuGpu;
        act.flow.start = false;
        logger.handleGenericActivity(call);
      }
      streams[a.device].insert(a.stream);
      logger.handleGenericActivity(act);
    }
    buffer_->span.startTime = start_time;
    buffer_->span.endTime = end_time;
    buffer_->gpuOpCount = int(buffer_->activities.size());
    // One process row per device, one thread row per stream, as a trace viewer shows a GPU.
    for (const auto& [device, ids] : streams) {
      libkineto::DeviceInfo info{device, device + kDeviceSortBase,
                                 fmt::format("openreg:{}", device),
                                 fmt::format("openreg {}", device)};
      logger.handleDeviceInfo(info, start_time);
      // Kineto names rows "GPU 0".."GPU 15" unless a plugin returns a DeviceInfo (it takes one).
      if (!device_info_) device_info_ = std::make_unique<libkineto::DeviceInfo>(info);
      for (int64_t id : ids)
        logger.handleResourceInfo({id, id, device, fmt::format("stream {}", id)}, start_time);
    }
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    return std::move(device_info_);
  }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {}; }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override {
    return std::move(buffer_);
  }

 private:
  libkineto::GenericTraceActivity& add(ActivityType type, const std::string& name,
                                       int64_t start_ns, int64_t end_ns, int32_t pid, int32_t tid,
                                       const libkineto::ITraceActivity* op) {
    auto& act = buffer_->activities.emplace_back(
        std::make_unique<libkineto::GenericTraceActivity>(buffer_->span, type, name));
    act->startTime = start_ns;
    act->endTime = end_ns;
    act->id = int32_t(++next_id_);
    act->device = pid;
    act->resource = tid;
    act->threadId = tid;
    act->linked = op;
    return *act;
  }

  static constexpr int64_t kDeviceSortBase = 0x1000000;  // device rows below the CPU's
  const std::set<ActivityType> types_;  // what the trace asked for
  bool recording_ = false;
  std::vector<DeviceActivity> records_;
  std::unique_ptr<libkineto::CpuTraceBuffer> buffer_ = std::make_unique<libkineto::CpuTraceBuffer>();
  uint64_t next_id_ = 0;
  std::unique_ptr<libkineto::DeviceInfo> device_info_;
};
// [docs:end SESSION]

// [docs:start PLUGIN]
class OpenRegActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<ActivityType>& availableActivities() const override { return types_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      const std::set<ActivityType>& activity_types, const libkineto::Config& config) override {
    std::set<ActivityType> asked;
    for (ActivityType t : types_)
      if (activity_types.count(t) != 0) asked.insert(t);
    if (asked.empty() || asked == std::set<ActivityType>{ActivityType::PRIVATEUSE1_RUNTIME})
      return nullptr;  // CPU-only profiling: the device records nothing, costs nothing
    return std::make_unique<Session>(asked);
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t ts_ms, int64_t duration_ms, const std::set<ActivityType>& activity_types,
      const libkineto::Config& config) override {
    return configure(activity_types, config);
  }

 private:
  const std::string name_ = "openreg";
  const std::set<ActivityType> types_ = {
      ActivityType::CONCURRENT_KERNEL, ActivityType::GPU_MEMCPY, ActivityType::GPU_MEMSET,
      ActivityType::PRIVATEUSE1_RUNTIME};
};

// Kineto is initialised lazily; the registry hands it our factory whenever that happens.
REGISTER_PRIVATEUSE1_PROFILER(OpenRegActivityProfiler);
// [docs:end PLUGIN]

// [docs:start STUBS]
// The legacy path: torch.autograd.profiler.profile(use_device="openreg") with its default
// use_kineto=False runs in the KINETO_PRIVATEUSE1_FALLBACK state, which times every op with two
// device events recorded on the current stream around it (record at entry and at exit) and
// reports elapsed(start, end) as the op's device time (privateuse1_elapsed_us).
struct Stubs final : public torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    const int d = current_device();
    if (device != nullptr) *device = static_cast<c10::DeviceIndex>(d);
    auto* e = new EventPtr(event_create(d, /*enable_timing=*/true));
    event_record(*e, current_stream(d));
    *event = std::shared_ptr<void>(e, [](void* p) { delete static_cast<EventPtr*>(p); });
    if (cpu_ns != nullptr) *cpu_ns = c10::getTime();
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* start,
                const torch::profiler::impl::ProfilerVoidEventStub* end) const override {
    const EventPtr& a = *static_cast<const EventPtr*>(start->get());
    const EventPtr& b = *static_cast<const EventPtr*>(end->get());
    event_synchronize(a);
    event_synchronize(b);
    return static_cast<float>(event_elapsed_ms(a, b) * 1000.0);  // microseconds
  }
  // Named markers and ranges (NVTX-style) have no consumer on this device.
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    const int previous = current_device();
    for (int d = 0; d < device_count(); ++d) {
      set_current_device(d);
      op(d);
    }
    set_current_device(previous);
  }
  void synchronize() const override { Recorder::synchronize_unrecorded(); }
};

struct RegisterStubs {
  RegisterStubs() {
    static Stubs stubs;
    torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  }
} register_stubs;
// [docs:end STUBS]

}  // namespace

// For tests and for the Python side: whether Kineto has taken our plugin.
bool profiler_registered() {
  return torch::profiler::impl::PrivateUse1ProfilerRegistry::instance().isRegisteredWithKineto();
}

}  // namespace openreg
