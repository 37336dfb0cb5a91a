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
  uint64_t correlation() override {
    auto& stack = correlation_stack();
    return stack.empty() ? 0 : stack.back();
  }
  void record(const DeviceActivity& activity) override {
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
  std::vector<DeviceActivity> end() {
    try {
      synchronize_all();
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
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: kernels may run during exit
  return *r;
}
// [docs:end RECORDER]

const char* copy_name(ActivityKind kind) {
  switch (kind) {
    case ActivityKind::CopyHtoD: return "Memcpy HtoD (Host -> openreg)";
    case ActivityKind::CopyDtoH: return "Memcpy DtoH (openreg -> Host)";
    case ActivityKind::CopyDtoD: return "Memcpy DtoD (openreg -> openreg)";
    default: return "";
  }
}

// [docs:start SESSION]
class Session final : public libkineto::IActivityProfilerSession {
 public:
  explicit Session(const std::set<ActivityType>& types)
      : kernels_(types.count(ActivityType::CONCURRENT_KERNEL) > 0),
        copies_(types.count(ActivityType::GPU_MEMCPY) > 0) {}
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
      const bool copy = a.kind != ActivityKind::Kernel;
      if (copy ? !copies_ : !kernels_) continue;
      const libkineto::ITraceActivity* op =
          a.correlation != 0 ? linked_activity(int32_t(a.correlation)) : nullptr;
      std::string name = copy ? copy_name(a.kind)
                              : (op != nullptr ? op->name() : std::string("openreg kernel")) +
                                    " (openreg kernel)";
      auto& act = buffer_->activities.emplace_back(std::make_unique<libkineto::GenericTraceActivity>(
          buffer_->span, copy ? ActivityType::GPU_MEMCPY : ActivityType::CONCURRENT_KERNEL,
          name));
      act->startTime = a.start_ns;
      act->endTime = a.end_ns;
      act->id = int32_t(++next_id_);
      act->device = a.device;
      act->resource = int32_t(a.stream);
      act->threadId = int32_t(a.stream);
      act->linked = op;
      act->addMetadata("device", a.device);
      act->addMetadata("stream", a.stream);
      act->addMetadata("correlation", a.correlation);
      if (copy) {
        act->addMetadata("bytes", a.bytes);
        const double ns = double(std::max<int64_t>(a.end_ns - a.start_ns, 1));
        act->addMetadata("memory bandwidth (GB/s)", fmt::format("{:.3f}", double(a.bytes) / ns));
      }
      streams[a.device].insert(a.stream);
      logger.handleGenericActivity(*act);
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
  static constexpr int64_t kDeviceSortBase = 0x1000000;  // device rows below the CPU's
  const bool kernels_;
  const bool copies_;
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
    if (activity_types.count(ActivityType::CONCURRENT_KERNEL) == 0 &&
        activity_types.count(ActivityType::GPU_MEMCPY) == 0)
      return nullptr;  // CPU-only profiling: the device records nothing, costs nothing
    return std::make_unique<Session>(activity_types);
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t ts_ms, int64_t duration_ms, const std::set<ActivityType>& activity_types,
      const libkineto::Config& config) override {
    return configure(activity_types, config);
  }

 private:
  const std::string name_ = "openreg";
  const std::set<ActivityType> types_ = {ActivityType::CONCURRENT_KERNEL,
                                         ActivityType::GPU_MEMCPY};
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
  void synchronize() const override { synchronize_all(); }
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
