// Native because: torch's profiler (Kineto) takes a device's activities only from a C++
// libkineto::IActivityProfiler registered with torch::profiler::impl::PrivateUse1ProfilerRegistry.
//
// Optional mechanism of minidev: device kernels in torch.profiler traces (docs/profiler.md).
// setup.py builds it as its own extension, minidev._profiler, with USE_KINETO, FMT_HEADER_ONLY
// and torch/include/kineto on the include path; minidev/__init__.py imports it when it is there.
// Without it, a profile holds CPU operators only and the core still passes every required check.
#include <ATen/record_function.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#include <torch/extension.h>

#include <IActivityProfiler.h>
#include <libkineto.h>
#include <output_base.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

namespace {

using libkineto::ActivityType;

// [docs:start PROFILER_RECORD]
// minidev runs every operator on the calling thread, most of them through the CPU fallback, so
// its "device kernel" is the interval of an outermost operator on minidev tensors (the one the
// program called, not the fallback's copies inside it), seen through a RecordFunction callback.
// A real device reports the kernels its driver ran and measured instead (CUPTI's role for CUDA).
struct Kernel {
  std::string name;
  int64_t start_ns, end_ns;
  int device;
  uint64_t correlation;  // the id torch gave the operator that launched it
};

std::mutex mutex;
std::vector<Kernel> kernels;  // recorded while a session runs
std::atomic<bool> recording{false};
thread_local std::vector<uint64_t> correlations;  // torch's ids of the operators running here
thread_local int depth = 0;                        // minidev operators running here

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

struct Started : at::ObserverContext {
  int64_t start_ns = now_ns();
  int device = -1;  // the device of its first minidev tensor argument
  bool outermost = false;
};

// Inputs are readable only here, at the operator's entry.
std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (!recording) return nullptr;
  for (const c10::IValue& input : fn.inputs()) {
    if (input.isTensor() && input.toTensor().device().is_privateuseone()) {
      auto started = std::make_unique<Started>();
      started->device = input.toTensor().device().index();
      started->outermost = depth++ == 0;
      return started;
    }
  }
  return nullptr;
}

// Runs before the profiler's own exit callback (global callbacks first), while torch's
// correlation id of this operator is still on top of the stack.
void on_exit(const at::RecordFunction& fn, at::ObserverContext* context) {
  auto* started = static_cast<Started*>(context);
  if (started == nullptr) return;
  --depth;
  if (!started->outermost || correlations.empty()) return;
  std::lock_guard<std::mutex> lock(mutex);
  kernels.push_back({fn.name(), started->start_ns, now_ns(), started->device, correlations.back()});
}
// [docs:end PROFILER_RECORD]

// [docs:start PROFILER_SESSION]
// One trace: torch starts and stops it with the profile, forwards the correlation id of every
// operator it records (on the operator's thread), then asks for the activities.
struct Session final : libkineto::IActivityProfilerSession {
  at::CallbackHandle callback = 0;

  void start() override {
    {
      std::lock_guard<std::mutex> lock(mutex);
      kernels.clear();
    }
    callback = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_enter, &on_exit).needsInputs(true)
            .scopes({at::RecordScope::FUNCTION}));
    recording = true;
    status_ = libkineto::TraceStatus::RECORDING;
  }
  void stop() override {
    recording = false;
    if (callback) at::removeCallback(callback);
    callback = 0;
    status_ = libkineto::TraceStatus::PROCESSING;
  }
  ~Session() override { stop(); }
  std::vector<std::string> errors() override { return {}; }
  void pushCorrelationId(uint64_t id) override { correlations.push_back(id); }
  void popCorrelationId() override {
    if (!correlations.empty()) correlations.pop_back();
  }

  // Each kernel becomes a CONCURRENT_KERNEL activity on its device's row, linked to the CPU
  // operator with its correlation id: torch then counts it as that operator's device time.
  void processTrace(libkineto::ActivityLogger& logger,
                    libkineto::getLinkedActivityCallback linked, int64_t start,
                    int64_t end) override {
    std::lock_guard<std::mutex> lock(mutex);
    int32_t id = 0;
    for (const Kernel& k : kernels) {
      auto& act = buffer->activities.emplace_back(std::make_unique<libkineto::GenericTraceActivity>(
          buffer->span, ActivityType::CONCURRENT_KERNEL, k.name + " (minidev kernel)"));
      act->startTime = k.start_ns;
      act->endTime = k.end_ns;
      act->id = ++id;
      act->device = k.device;
      act->resource = act->threadId = 0;  // the device's one stream
      act->linked = linked(static_cast<int32_t>(k.correlation));
      logger.handleGenericActivity(*act);
    }
    buffer->span.startTime = start;
    buffer->span.endTime = end;
  }
  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, [](int32_t) -> const libkineto::ITraceActivity* { return nullptr; }, 0, 0);
  }
  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override { return nullptr; }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {}; }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return std::move(buffer); }

  std::unique_ptr<libkineto::CpuTraceBuffer> buffer = std::make_unique<libkineto::CpuTraceBuffer>();
};

struct MinidevProfiler final : libkineto::IActivityProfiler {
  const std::string& name() const override { return name_; }
  const std::set<ActivityType>& availableActivities() const override { return types_; }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      const std::set<ActivityType>& asked, const libkineto::Config&) override {
    if (asked.count(ActivityType::CONCURRENT_KERNEL) == 0) return nullptr;  // CPU-only profile
    return std::make_unique<Session>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t, int64_t, const std::set<ActivityType>& asked,
      const libkineto::Config& config) override {
    return configure(asked, config);
  }
  const std::string name_ = "minidev";
  const std::set<ActivityType> types_ = {ActivityType::CONCURRENT_KERNEL};
};

// Kineto initialises lazily, at the first profile: the registry hands it this factory then.
REGISTER_PRIVATEUSE1_PROFILER(MinidevProfiler);
// [docs:end PROFILER_SESSION]

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}  // loading the library registers the plugin
