// Native because: PyTorch accepts a graph implementation only as a C++ at::GraphImplInterface
// (GraphImplRegistry), and the recording happens inside the C++ kernels (generic fallback,
// native kernels, copies) on the per-operator path.
//
// Graph capture and replay (docs/graphs.md). While a stream captures (runtime/stream.cpp), the
// kernels issued on it are recorded instead of run: each recorded operator keeps its CPU kernel
// and CPU aliases of the device memory it reads and writes, so a replay is a loop of CPU kernel
// calls on the same memory, without the dispatcher's upper layers, autograd or Python.
#include "adapters/graph.h"

#include "adapters/device_allocator.h"
#include "adapters/generator.h"
#include "ops/cpu_kernel.h"
#include "runtime/device.h"
#include "runtime/memory.h"

#include <ATen/core/GraphImplInterface.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <sstream>

namespace openreg {
namespace {

constexpr auto kOpenReg = c10::DeviceType::PrivateUse1;

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "None";
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes();
  if (t.device().type() == kOpenReg)
    os << "@" << t.device() << ":" << static_cast<const void*>(t.storage().data())
       << (t.storage_offset() ? "+" + std::to_string(t.storage_offset()) : "");
  else
    os << "@" << t.device();
  return os.str();
}

std::string describe(const c10::IValue& v) {
  if (v.isTensor()) return describe(v.toTensor());
  if (v.isTensorList()) {
    std::string s = "[";
    for (const at::Tensor& t : v.toTensorList()) s += (s.size() > 1 ? ", " : "") + describe(t);
    return s + "]";
  }
  if (v.isGenerator()) return "Generator(" + c10::str(v.toGenerator().device()) + ")";
  std::ostringstream os;
  os << v;
  std::string s = os.str();
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

bool is_device(const at::Tensor& t) { return t.defined() && t.device().type() == kOpenReg; }

// [docs:start META_ARGS]
// The operator's Meta kernel computes the outputs' sizes, strides and dtypes without running it.
c10::IValue to_meta(const c10::IValue& v) {
  auto meta = [](const at::Tensor& t) -> at::Tensor {
    if (!is_device(t)) return t;
    at::Tensor m = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
    if (t.is_conj()) m._set_conj(true);
    if (t.is_neg()) m._set_neg(true);
    return m;
  };
  if (v.isTensor()) return meta(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(meta(t));
    return out;
  }
  if (v.isList() && v.toListRef().size() > 0 && v.toListRef()[0].isTensor() == false &&
      !v.toListRef()[0].isNone())
    return v;
  if (v.isList()) {  // Tensor?[]
    bool tensors = false;
    for (const auto& e : v.toListRef()) tensors |= e.isTensor();
    if (!tensors) return v;
    c10::List<std::optional<at::Tensor>> out;
    for (const auto& e : v.toListRef())
      out.push_back(e.isTensor() ? std::optional<at::Tensor>(meta(e.toTensor())) : std::nullopt);
    return out;
  }
  if (v.isGenerator()) return c10::IValue();  // Meta kernels draw nothing
  if (v.isDevice() && v.toDevice().type() == kOpenReg) return c10::Device(c10::kMeta);
  return v;
}
// [docs:end META_ARGS]

// A CPU alias of device memory for replay: not owning pool memory, owning the rest.
at::Tensor alias_for_replay(const at::Tensor& t) {
  if (!is_device(t)) return t;
  return graph_alias(t);
}

c10::IValue replay_arg(const c10::IValue& v, ReplayOn on) {
  if (on == ReplayOn::PrivateUse1) return v;  // the openreg kernel takes device tensors
  if (v.isTensor()) return alias_for_replay(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(alias_for_replay(t));
    return out;
  }
  if (v.isList()) {
    bool tensors = false;
    for (const auto& e : v.toListRef()) tensors |= e.isTensor();
    if (!tensors) return v;
    c10::List<std::optional<at::Tensor>> out;
    for (const auto& e : v.toListRef())
      out.push_back(e.isTensor() ? std::optional<at::Tensor>(alias_for_replay(e.toTensor()))
                                 : std::nullopt);
    return out;
  }
  if (v.isDevice() && v.toDevice().type() == kOpenReg) return c10::Device(c10::DeviceType::CPU);
  return v;
}

at::Tensor allocate_like_meta(const at::Tensor& m, int device) {
  return at::empty_strided(m.sizes(), m.strides(),
                           m.options().device(c10::Device(kOpenReg, device)));
}

// [docs:start OUT_VARIANT]
// The out= overload of a functional operator (add.Tensor -> add.out), when its arguments are the
// functional ones followed by one out= tensor per result: a replay then writes the results in
// place instead of allocating them and copying them over.
std::optional<c10::OperatorHandle> out_variant(const c10::OperatorHandle& op, size_t num_results) {
  static std::mutex mutex;
  static std::unordered_map<const c10::FunctionSchema*, std::optional<c10::OperatorHandle>> cache;
  const auto& schema = op.schema();
  std::lock_guard lock(mutex);
  auto it = cache.find(&schema);
  if (it != cache.end()) return it->second;
  std::optional<c10::OperatorHandle> found;
  const std::string& overload = schema.overload_name();
  for (const std::string& candidate : {overload.empty() ? std::string("out") : overload + "_out",
                                       std::string("out")}) {
    auto h = c10::Dispatcher::singleton().findSchema({schema.name(), candidate});
    if (!h || !(h->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
                h->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)))
      continue;
    const auto& out = h->schema();
    const size_t n = schema.arguments().size();
    bool ok = out.arguments().size() == n + num_results &&
              out.returns().size() == num_results;
    for (size_t i = 0; ok && i < n; ++i)
      ok = out.arguments()[i].name() == schema.arguments()[i].name() &&
           *out.arguments()[i].type() == *schema.arguments()[i].type();
    for (size_t i = n; ok && i < n + num_results; ++i) {
      const auto* alias = out.arguments()[i].alias_info();
      ok = alias != nullptr && alias->isWrite() && out.arguments()[i].kwarg_only() &&
           out.arguments()[i].type()->kind() == c10::TypeKind::TensorType;
    }
    if (ok) {
      found = *h;
      break;
    }
  }
  cache.emplace(&schema, found);
  return found;
}
// [docs:end OUT_VARIANT]

}  // namespace

at::Tensor graph_alias(const at::Tensor& t) {
  const c10::Storage& storage = t.storage();
  if (!in_private_pool(t.device().index(), storage.data())) return cpu_alias(t);
  c10::Storage view(c10::Storage::use_byte_size_t(), storage.nbytes(),
                    c10::DataPtr(const_cast<void*>(storage.data()), c10::Device(c10::kCPU)),
                    /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor a = at::detail::make_tensor<c10::TensorImpl>(
      std::move(view), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  a.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) a._set_conj(true);
  if (t.is_neg()) a._set_neg(true);
  return a;
}

// [docs:start CAPTURE_OP]
void capture_op(Capture* capture, const c10::OperatorHandle& op, c10::Stack* stack, int device,
                ReplayOn on, MetaKernel meta_kernel) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  std::vector<c10::IValue> args(stack->begin() + first, stack->end());
  stack->resize(first);

  // 1. Shapes of the results, from the Meta kernel.
  c10::Stack meta;
  meta.reserve(num_args);
  for (const auto& v : args) meta.push_back(to_meta(v));
  try {
    if (meta_kernel != nullptr) meta_kernel(&meta);
    else op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &meta);
  } catch (c10::Error& e) {
    capture_fail(capture, c10::str("openreg: ", schema.operator_name(), " cannot be captured in "
                                   "a graph: its output shapes could not be inferred without "
                                   "running it (", e.what_without_backtrace(), ")"));
  } catch (std::exception& e) {  // a Python Meta kernel's error
    capture_fail(capture, c10::str("openreg: ", schema.operator_name(), " cannot be captured in "
                                   "a graph: its output shapes could not be inferred without "
                                   "running it (", e.what(), ")"));
  }

  // 2. Arguments written in place that the kernel would resize (out=): resize them now.
  for (size_t i = 0; i < num_args; ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias == nullptr || !alias->isWrite() || !args[i].isTensor()) continue;
    const at::Tensor& t = args[i].toTensor();
    for (size_t r = 0; r < schema.returns().size(); ++r) {
      const auto* ra = schema.returns()[r].alias_info();
      if (ra && ra->beforeSets() == alias->beforeSets() && meta[r].isTensor() &&
          is_device(t) && meta[r].toTensor().sizes() != t.sizes())
        t.resize_(meta[r].toTensor().sizes());
    }
  }

  // 3. Results: an argument itself (in-place and out= operators) or a new device tensor.
  const size_t num_returns = schema.returns().size();
  std::vector<int> fresh;  // which returns are new tensors (copied into at replay)
  std::vector<c10::IValue> results;
  for (size_t r = 0; r < num_returns; ++r) {
    const auto* ra = schema.returns()[r].alias_info();
    if (ra != nullptr) {
      bool found = false;
      for (size_t i = 0; i < num_args && !found; ++i) {
        const auto* a = schema.arguments()[i].alias_info();
        if (a && a->beforeSets() == ra->beforeSets()) {
          results.push_back(args[i]);
          found = true;
        }
      }
      if (found && !ra->isWrite() && meta[r].isTensor() && results.back().isTensor()) {
        // [docs:start CAPTURE_VIEW]
        // A view (unfold, view_as_complex): no device work, only metadata. Made now, over the
        // argument's storage, with the sizes, strides, dtype and offset (in bytes) the Meta
        // kernel gives relative to its own input.
        const at::Tensor base = results.back().toTensor();
        const at::Tensor& m = meta[r].toTensor();
        at::Tensor view = make_device_tensor(base.storage(), m);
        const int64_t offset_bytes = base.storage_offset() * int64_t(base.itemsize()) +
                                     m.storage_offset() * int64_t(m.itemsize());
        view.unsafeGetTensorImpl()->set_storage_offset(offset_bytes / int64_t(m.itemsize()));
        results.back() = view;
        continue;
        // [docs:end CAPTURE_VIEW]
      }
      if (!found || !ra->isWrite())
        capture_fail(capture, c10::str("openreg: ", schema.operator_name(), " cannot be captured "
                                       "in a graph: it returns a view of a kind capture does not "
                                       "support"));
      continue;
    }
    const c10::IValue& m = meta[r];
    if (m.isTensor()) {
      const at::Tensor& mt = m.toTensor();
      results.push_back(mt.defined() ? c10::IValue(allocate_like_meta(mt, device))
                                     : c10::IValue(at::Tensor()));
      fresh.push_back(static_cast<int>(r));
    } else if (m.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& mt : m.toTensorList()) out.push_back(allocate_like_meta(mt, device));
      results.push_back(out);
      fresh.push_back(static_cast<int>(r));
    } else if (m.isNone() || m.isInt() || m.isSymInt() || m.isDouble() || m.isBool()) {
      // A host value from the Meta kernel cannot depend on the data (Meta tensors have none):
      // it comes from shapes (attention's max_q/max_k) and stays the same at every replay.
      results.push_back(m);
    } else {
      capture_fail(capture, c10::str("openreg: ", schema.operator_name(), " cannot be captured "
                                     "in a graph: it returns a host value (", m.tagKind(),
                                     ") that depends on the data (operation not permitted when "
                                     "stream is capturing)"));
    }
  }

  // A view operator does no device work: nothing to record.
  bool writes = !fresh.empty();
  for (const auto& arg : schema.arguments())
    writes |= arg.alias_info() != nullptr && arg.alias_info()->isWrite();
  if (!writes) {
    for (auto& v : results) stack->push_back(std::move(v));
    return;
  }

  // 4. The recorded work: the kernel on the same memory, fresh results copied into place.
  std::vector<c10::IValue> replay_args;
  std::vector<std::pair<size_t, at::Generator>> generators;
  for (size_t i = 0; i < num_args; ++i) {
    if (args[i].isGenerator() || (schema.arguments()[i].type()->kind() == c10::TypeKind::OptionalType &&
                                  schema.arguments()[i].type()->castRaw<c10::OptionalType>()
                                          ->getElementType()->kind() == c10::TypeKind::GeneratorType)) {
      std::optional<at::Generator> g;
      if (args[i].isGenerator()) g = args[i].toGenerator();
      // [docs:start CAPTURE_RANDOM]
      // Random operators: the generator is resolved now, drawn from at each replay (each replay
      // advances it as an eager run would, so replays give fresh random numbers).
      const at::Generator& gen = (g.has_value() && g->defined()) ? *g : default_generator(device);
      // [docs:end CAPTURE_RANDOM]
      generators.emplace_back(i, gen);
      replay_args.push_back(on == ReplayOn::Cpu ? c10::IValue() : c10::IValue(gen));
      continue;
    }
    replay_args.push_back(replay_arg(args[i], on));
  }
  std::vector<c10::IValue> targets;  // where fresh results go (CPU aliases or device tensors)
  for (int r : fresh) {
    if (on == ReplayOn::PrivateUse1) targets.push_back(results[r]);
    else targets.push_back(replay_arg(results[r], ReplayOn::Cpu));
  }

  // A replay runs each kernel with the OpenMP thread count of the thread that captured it (a
  // captured backward: the autograd device thread's one thread), as the eager run did.
  const int threads = kernel_thread_count();

  // Functional operator with only tensor results: replay its out= overload into the targets.
  std::optional<c10::OperatorHandle> out_op;
  if (on == ReplayOn::Cpu && fresh.size() == num_returns && num_returns > 0) {
    bool tensors = true;
    for (int r : fresh) tensors &= results[r].isTensor() && results[r].toTensor().defined();
    if (tensors) out_op = out_variant(op, num_returns);
  }
  if (out_op) {
    for (const auto& t : targets) replay_args.push_back(t);
    std::string what = c10::str(out_op->schema().operator_name());
    std::string a;
    for (const auto& v : args) a += (a.empty() ? "" : ", ") + describe(v);
    std::string rs;
    for (const auto& v : results) rs += (rs.empty() ? "" : ", ") + describe(v);
    what += "(" + a + ", out=" + rs + ")";
    capture_record(capture, std::move(what),
                   [op = *out_op, replay_args = std::move(replay_args),
                    generators = std::move(generators), device, threads]() {
      c10::Stack s(replay_args.begin(), replay_args.end());
      for (const auto& [i, gen] : generators) s[i] = cpu_generator_for(gen, device);
      KernelThreadCount same_threads(threads);
      KernelScope kernel;
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &s);
    });
    for (auto& v : results) stack->push_back(std::move(v));
    return;
  }

  std::string what = c10::str(schema.operator_name());
  {
    std::string a;
    for (const auto& v : args) a += (a.empty() ? "" : ", ") + describe(v);
    std::string rs;
    for (const auto& v : results) rs += (rs.empty() ? "" : ", ") + describe(v);
    what += "(" + a + ") -> (" + rs + ")";
    if (on == ReplayOn::PrivateUse1) what += "  [openreg kernel]";
  }

  capture_record(capture, std::move(what),
                 [op, replay_args = std::move(replay_args), generators = std::move(generators),
                  targets = std::move(targets), fresh = std::move(fresh), device, on,
                  num_returns, threads]() {
    c10::Stack s(replay_args.begin(), replay_args.end());
    for (const auto& [i, gen] : generators)
      if (on == ReplayOn::Cpu) s[i] = cpu_generator_for(gen, device);
    KernelThreadCount same_threads(threads);
    KernelScope kernel;
    op.redispatchBoxed(c10::DispatchKeySet(on == ReplayOn::Cpu ? c10::DispatchKey::CPU
                                                               : c10::DispatchKey::PrivateUse1),
                       &s);
    const size_t base = s.size() - num_returns;
    for (size_t k = 0; k < fresh.size(); ++k) {
      const c10::IValue& got = s[base + fresh[k]];
      const c10::IValue& into = targets[k];
      if (got.isTensor()) {
        if (got.toTensor().defined()) into.toTensor().copy_(got.toTensor());
      } else if (got.isTensorList()) {
        auto dst = into.toTensorList();
        auto src = got.toTensorList();
        for (size_t j = 0; j < src.size(); ++j) dst.get(j).copy_(src.get(j));
      }
    }
  });
  for (auto& v : results) stack->push_back(std::move(v));
}
// [docs:end CAPTURE_OP]

namespace {

std::atomic<uint64_t> g_next_pool{1};

// [docs:start GRAPH_IMPL]
class OpenRegGraph final : public at::GraphImplInterface {
 public:
  explicit OpenRegGraph(const at::GraphImplArgs& args) : keep_graph_(args.keep_graph) {}
  ~OpenRegGraph() override {
    try {
      reset();
    } catch (...) {
    }
  }

  void capture_begin(c10::MempoolId_t pool, at::GraphCaptureMode mode) override {
    TORCH_CHECK(!captured_ && !capturing_, "openreg: this graph already holds a capture; call "
                "reset() before capturing again");
    const int device = current_device();
    Stream* stream = current_stream(device);
    // A new private pool, or the one of another graph (pool=other.pool()).
    pool_ = (pool.first == 0 && pool.second == 0) ? c10::MempoolId_t{g_next_pool++, 0} : pool;
    capture_.pool_key = pool_acquire(device, pool_);
    has_pool_ = true;
    capture_.mode = mode == at::GraphCaptureMode::ThreadLocal ? CaptureMode::ThreadLocal
                    : mode == at::GraphCaptureMode::Relaxed   ? CaptureMode::Relaxed
                                                              : CaptureMode::Global;
    openreg::capture_begin(stream, &capture_);
    capturing_ = true;
  }

  void capture_end() override {
    TORCH_CHECK(capturing_, "openreg: capture_end without capture_begin");
    Stream* stream = current_stream(capture_.device);
    TORCH_CHECK(stream_id(stream) == capture_.stream_id, "openreg: capture must end on the stream "
                "it began on (stream ", capture_.stream_id, " of openreg:", capture_.device,
                "), but the current stream is ", stream_id(stream));
    capturing_ = false;
    openreg::capture_end(stream, &capture_);  // raises if the capture was invalidated
    captured_ = raw_ = true;
    if (!keep_graph_) instantiate();
  }

  void instantiate() override {
    TORCH_CHECK(captured_, "openreg: instantiate() needs a captured graph (capture first)");
    TORCH_CHECK(raw_, "openreg: the captured graph was already instantiated and not kept "
                "(construct the Graph with keep_graph=True to instantiate it again)");
    exec_.clear();
    for (const auto& w : capture_.work) exec_.push_back(w.run);
    instantiated_ = true;
    if (!keep_graph_) {  // the raw graph is not kept (debug mode keeps its description)
      raw_ = false;
      if (!debug_) capture_.work.clear();
    }
  }

  void replay() override {
    TORCH_CHECK(captured_, "openreg: replay() needs a captured graph (capture first)");
    if (!instantiated_) instantiate();
    c10::impl::VirtualGuardImpl guard(kOpenReg);
    const c10::Device previous = guard.exchangeDevice(c10::Device(kOpenReg, capture_.device));
    struct Restore {
      c10::impl::VirtualGuardImpl& g;
      c10::Device d;
      ~Restore() { g.uncheckedSetDevice(d); }
    } restore{guard, previous};
    // [docs:start REPLAY]
    // On the current stream, in stream order, holding it for the whole replay.
    Stream* stream = current_stream(capture_.device);
    TORCH_CHECK(stream_capture(stream) == nullptr, "openreg: replaying a graph on a stream that "
                "captures another graph is not supported");
    LaunchScope launch(stream);
    mark_launch_as(ActivityKind::GraphReplay, 0);  // one device activity for the profiler
    for (const auto& run : exec_) run();
    // [docs:end REPLAY]
  }

  void reset() override {
    if (capturing_) {
      Stream* stream = get_stream(capture_.device, capture_.stream_id);
      capturing_ = false;
      try {
        openreg::capture_end(stream, &capture_);
      } catch (...) {
      }
    }
    exec_.clear();
    capture_.work.clear();
    captured_ = instantiated_ = raw_ = false;
    if (has_pool_) {
      pool_release(capture_.device, pool_);
      has_pool_ = false;
    }
  }

  c10::MempoolId_t pool() const override { return pool_; }

  void enable_debug_mode() override { debug_ = true; }

  void debug_dump(const std::string& path) override {
    if (!debug_) {
      TORCH_WARN("openreg: graph debug mode is not enabled; call enable_debug_mode() before "
                 "capturing to dump the graph");
      return;
    }
    TORCH_CHECK(captured_, "openreg: debug_dump() needs a captured graph");
    std::ofstream out(path);
    TORCH_CHECK(out, "openreg: cannot open ", path, " for writing");
    out << "# openreg graph: openreg:" << capture_.device << ", captured on stream "
        << capture_.stream_id << ", pool (" << pool_.first << ", " << pool_.second << "), "
        << capture_.work.size() << " nodes\n";
    for (size_t i = 0; i < capture_.work.size(); ++i)
      out << i << ": " << capture_.work[i].what << "\n";
  }

 private:
  const bool keep_graph_;
  bool debug_ = false;
  bool capturing_ = false;
  bool captured_ = false;
  bool instantiated_ = false;
  bool raw_ = false;  // the captured (not instantiated) graph is held
  bool has_pool_ = false;
  c10::MempoolId_t pool_{0, 0};
  Capture capture_;
  std::vector<std::function<void()>> exec_;
};
// [docs:end GRAPH_IMPL]

// [docs:start GRAPH_REGISTRATION]
// The registry key is c10::DeviceTypeName(PrivateUse1): "PRIVATEUSEONE" before the backend is
// renamed, "OPENREG" after (torch_openreg renames it at import).
}  // namespace
}  // namespace openreg

namespace at {
C10_REGISTER_CLASS(GraphImplRegistry, OPENREG, openreg::OpenRegGraph)
C10_REGISTER_CLASS(GraphImplRegistry, PRIVATEUSEONE, openreg::OpenRegGraph)
}  // namespace at
// [docs:end GRAPH_REGISTRATION]
