// Native because: the asynchronous kernel mode is a branch of the generic fallback, the
// per-operator hot path (ops/fallback.cpp).
//
// How an operator runs in the asynchronous kernel mode (docs/async_mode.md):
//   1. on the host, the operator's meta kernel runs on meta tensors that mirror the arguments
//      (sizes, strides, offsets, dtypes, and which arguments share a storage): it checks the
//      arguments as the CPU kernel would and tells the outputs' metadata;
//   2. the host allocates the fresh outputs through the device allocator, on the current stream
//      (outputs that view an argument's storage stay views of the device storage; in-place and
//      out= operators return their argument), and returns them at once;
//   3. the stream's worker runs the CPU kernel later, in stream order, on CPU tensors over the
//      same device memory, and copies each fresh result into the output the host handed out.
// Like a GPU kernel, the queued kernel does not own the memory it uses: memory freed by the host
// meanwhile is reused in stream order only (the caching allocator keeps blocks per stream;
// record_stream covers other streams), and the allocator waits for queued kernels before it
// releases segments to the driver (runtime/stream.h, wait_for_queued_kernels).
#include "ops/async_kernel.h"

#include "runtime/device_profile.h"

#include "adapters/device_allocator.h"
#include "ops/cow.h"
#include "ops/cpu_kernel.h"
#include "runtime/device.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace openreg {

std::atomic<bool> g_async_kernels{false};

namespace {
std::atomic<int64_t> g_queued{0};
std::atomic<int64_t> g_synchronous{0};
}  // namespace

AsyncCounts async_counts() { return {g_queued.load(), g_synchronous.load()}; }

void set_async_kernels(bool on) {
  g_async_kernels = on;
  set_launch_reports_errors(on);
}

namespace {

constexpr auto kOpenReg = c10::DeviceType::PrivateUse1;
// A backend key nobody registers kernels for: its slot in each operator's dispatch table holds
// what PyTorch gives backends without their own kernel, e.g. the structured wrappers.
constexpr auto kWrapperKey = c10::DispatchKey::PrivateUse3;

bool is_tensor_type(const c10::TypePtr& type) {
  const c10::Type* t = type.get();
  if (t->kind() == c10::TypeKind::OptionalType)
    t = t->castRaw<c10::OptionalType>()->getElementType().get();
  if (t->kind() == c10::TypeKind::ListType)
    t = t->castRaw<c10::ListType>()->getElementType().get();
  return t->kind() == c10::TypeKind::TensorType;
}

// [docs:start ASYNC_ELIGIBLE]
// What the mode does with an operator, decided once per operator.
struct OpPlan {
  // May be queued at all. The others run synchronously (in stream order, after the queued
  // work): their results must exist before they return.
  bool eligible = false;
  // A structured operator's functional or in-place form: its generic wrapper (the kernel
  // PyTorch registers for backends without their own) checks the arguments with the C++ meta
  // function, allocates the outputs on the device and calls the `.out` form, which is queued.
  bool structured_wrapper = false;
  // Has a meta kernel written in C++ (not Python, not a composite kernel), which gives the
  // outputs' metadata.
  bool cpp_meta = false;
  // Every return is an argument written in place (in-place and out= forms): for each return,
  // the index of that argument.
  bool returns_written_args = false;
  std::vector<size_t> returned_arg;
};

// Whether the operator's Meta kernel is a meta kernel written in C++, read from the
// dispatcher's description of its table ("Meta: registered at <file>:<line> [kernel]"). Not one:
// a kernel registered from Python (torch.library, "<file>.py:<line>"), the Meta key's backend
// fallback ("[backend fallback]": no meta kernel), and a composite kernel that the Meta key
// falls back to ("[default backend kernel]"), which calls other operators whose meta kernels
// may be Python ones: the foreach operators' call one per tensor of the list, 85 us each.
bool meta_in_cpp(const c10::OperatorHandle& op) {
  const std::string table = "\n" + op.dumpComputedTable();
  const size_t line = table.find("\nMeta: ");
  if (line == std::string::npos) return false;
  const size_t end = table.find('\n', line + 1);
  const std::string meta = table.substr(line, end == std::string::npos ? end : end - line);
  return meta.find(" [kernel]") != std::string::npos && meta.find(".py:") == std::string::npos;
}

OpPlan compute_plan(const c10::OperatorHandle& op, const ArgSummary& s) {
  OpPlan plan;
  const auto& schema = op.schema();
  if (schema.name().rfind("aten::", 0) != 0) return plan;  // CPU kernels of other namespaces
                                                           // may be Python (the GIL)
  // Random operators draw from the device generator in program order (generator.md).
  if (s.has_generator || op.hasTag(at::Tag::nondeterministic_seeded)) return plan;
  // Output shapes or returned values that depend on the data (nonzero, unique, masked_select).
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output))
    return plan;
  if (s.cpu_tensors_allowed) return plan;  // index with CPU indices
  // Meta kernels that disagree with the CPU kernel about an output (found by
  // tests/test_op_conformance.py): native_layer_norm's mean and rstd are float32 for reduced
  // precision inputs on meta (CUDA's convention), in the input's dtype on the CPU.
  if (schema.name() == "aten::native_layer_norm") return plan;
  // Only tensors can be handed out before they are computed (not bool, Scalar, int, ...).
  for (const auto& ret : schema.returns())
    if (!is_tensor_type(ret.type())) return plan;
  // Checks and host side effects (_assert_tensor_metadata, _print): nothing to queue.
  if (schema.returns().empty() && !s.any_writes) return plan;
  plan.structured_wrapper =
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) &&
      !op.hasKernelForDispatchKey(kWrapperKey);
  // Otherwise a meta kernel gives the outputs' metadata, if it is a C++ one: a meta kernel
  // written in Python (torch/_meta_registrations.py registers many, over the C++ ones) costs
  // 100-250 us per call, far more than running the operator synchronously (docs/async_mode.md).
  plan.eligible = true;
  plan.cpp_meta = meta_in_cpp(op);
  plan.returns_written_args = s.any_writes;
  for (const auto& ret : schema.returns()) {
    const auto* alias = ret.alias_info();
    size_t found = s.kinds.size();
    if (alias != nullptr && alias->isWrite())
      for (size_t i = 0; i < s.kinds.size(); ++i) {
        const auto* arg = schema.arguments()[i].alias_info();
        if (s.kinds[i] == ArgKind::Tensor && arg != nullptr && arg->isWrite() &&
            arg->beforeSets() == alias->beforeSets())
          found = i;
      }
    if (found == s.kinds.size()) plan.returns_written_args = false;
    plan.returned_arg.push_back(found);
  }
  return plan;
}
// [docs:end ASYNC_ELIGIBLE]

const OpPlan& plan_for(const c10::OperatorHandle& op, const ArgSummary& s) {
  thread_local std::unordered_map<const c10::FunctionSchema*, OpPlan> cache;
  const auto* key = &op.schema();
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  return cache.emplace(key, compute_plan(op, s)).first->second;
}

// Set while a structured wrapper runs: the `.out` call it makes has outputs of the right shape,
// checked by the wrapper's meta function, so it needs no meta kernel of its own.
thread_local bool t_checked_by_wrapper = false;

c10::Storage meta_storage(size_t nbytes, bool resizable) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes,
                      c10::DataPtr(nullptr, c10::Device(c10::DeviceType::Meta)),
                      c10::GetAllocator(c10::DeviceType::Meta), resizable);
}

// A CPU storage over device memory that it does not own (the queued kernel's view of it).
c10::Storage cpu_view_storage(const c10::Storage& device_storage) {
  return c10::Storage(c10::Storage::use_byte_size_t(), device_storage.nbytes(),
                      c10::DataPtr(const_cast<void*>(device_storage.data()),
                                   c10::Device(c10::DeviceType::CPU)),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

// Queues `work` on `s` as an asynchronous kernel. While a profiler records, the kernel is
// reported with the interval during which the stream's worker ran it, issued by this thread.
void queue(Stream* s, ActivityKind kind, size_t bytes, std::function<void()> work) {
  Issuer issuer;
  if (ActivityRecorder* recorder = activity_recorder()) {
    issuer = recorder->issuer();
    issuer.start_ns = issuer.end_ns = activity_clock_ns();
  }
  const int device = stream_device(s);
  const int64_t id = stream_id(s);
  // [docs:start ASYNC_THREADS]
  // The kernel runs with the OpenMP thread count of the thread that issued it, as it would have
  // run on that thread in the default mode (cpu_kernel.cpp, KERNEL_THREADS): the count is part of
  // the result, so a signature's first call (run synchronously, on the caller) and its queued
  // calls give the same bits (docs/determinism.md).
  // OPENREG_ASYNC_OMP_THREADS=<n> gives every queued kernel n threads instead: faster where the
  // program also runs its own CPU work (one OpenMP team in the process, not two), at the price of
  // results that differ in the last bits from the default mode's (docs/determinism.md).
  static const int forced = [] {
    const char* env = std::getenv("OPENREG_ASYNC_OMP_THREADS");
    return env != nullptr ? std::atoi(env) : 0;
  }();
  const int threads = forced > 0 ? forced : kernel_thread_count();
  stream_enqueue_kernel(s, [work = std::move(work), issuer, kind, bytes, device, id, threads] {
    use_kernel_thread_count(threads);
    // [docs:end ASYNC_THREADS]
    const int64_t start = issuer.start_ns != 0 ? activity_clock_ns() : 0;
    work();
    if (start != 0)
      if (ActivityRecorder* recorder = activity_recorder())
        recorder->record({kind, device, id, start, activity_clock_ns(), bytes, issuer, ""});
  });
}

// Warnings of the meta kernel are held back: if the operator then runs synchronously, its CPU
// kernel gives them (once); if it is queued, they are given on the host at the launch.
struct WarningBuffer : c10::WarningHandler {
  std::vector<c10::Warning> warnings;
  void process(const c10::Warning& w) override { warnings.push_back(w); }
};
// The queued CPU kernel's warnings were given on the host already: by the meta kernel, or by the
// first call of the signature (a signature whose first call warned is never queued, see
// Learned::warns). Only a warning that depends on the values of the tensors could be lost here.
struct DropWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// What the worker runs.
struct QueuedKernel {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // CPU views of device memory, copies of host scalars
  struct Output {
    size_t ret;         // index among the operator's returns
    int64_t item;       // index in a returned list, -1 for a tensor
    at::Tensor dest;    // CPU view of the output the host handed out
  };
  std::vector<Output> fresh;  // outputs to fill with the CPU kernel's results
};

// [docs:start ASYNC_RUN]
void run_queued(QueuedKernel& k, int device, int64_t stream) {
  set_current_stream_id(device, stream);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  DropWarnings drop;
  c10::WarningUtils::WarningHandlerGuard quiet(&drop);
  KernelScope memory;  // device pages host-accessible (strict memory mode)
  c10::Stack stack(std::make_move_iterator(k.args.begin()), std::make_move_iterator(k.args.end()));
  k.args.clear();
  try {
    k.op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &stack);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, k.op.schema().operator_name(), " failed in a kernel queued by the "
                "asynchronous kernel mode: ", e.what_without_backtrace());
  }
  const size_t first = stack.size() - k.op.schema().returns().size();
  for (const auto& out : k.fresh) {
    const c10::IValue& v = stack[first + out.ret];
    at::Tensor result = out.item < 0 ? v.toTensor() : v.toTensorList().get(out.item);
    TORCH_CHECK(result.defined() && result.sizes() == out.dest.sizes() &&
                    result.dtype() == out.dest.dtype(),
                "openreg: ", k.op.schema().operator_name(), " (asynchronous kernel mode): its "
                "CPU kernel returned ",
                result.defined() ? c10::str(result.dtype(), " of shape ", result.sizes())
                                 : std::string("nothing"),
                " where its meta kernel announced ", out.dest.dtype(), " of shape ",
                out.dest.sizes(), " (please report; OPENREG_ASYNC=0 avoids it)");
    if (result.data_ptr() == out.dest.data_ptr() && result.strides() == out.dest.strides() &&
        result.dtype() == out.dest.dtype())
      continue;
    out.dest.copy_(result);
  }
}
// [docs:end ASYNC_RUN]

// One launch: the meta and CPU counterparts of the arguments, and the outputs.
class Launch {
 public:
  // Without meta, only the CPU forms are made (an operator checked by a structured wrapper).
  Launch(int device, bool with_meta) : device_(device), with_meta_(with_meta) {}

  // Converts one argument into its meta form (for the meta kernel) and its CPU form (for the
  // queued kernel). Returns false for an argument that cannot be queued.
  bool convert(const c10::IValue& v, ArgKind kind, bool written, c10::IValue& meta,
               c10::IValue& cpu) {
    switch (kind) {
      case ArgKind::Tensor:
        if (v.isTensor()) {
          at::Tensor m, c;
          if (!tensor(v.toTensor(), written, m, c)) return false;
          meta = std::move(m);
          cpu = std::move(c);
          return true;
        }
        break;
      case ArgKind::TensorList:
        if (v.isTensorList()) {
          c10::List<at::Tensor> ml, cl;
          for (const at::Tensor& t : v.toTensorList()) {
            at::Tensor m, c;
            if (!tensor(t, written, m, c)) return false;
            ml.push_back(std::move(m));
            cl.push_back(std::move(c));
          }
          meta = std::move(ml);
          cpu = std::move(cl);
          return true;
        }
        break;
      case ArgKind::OptionalTensorList:
        if (v.isList()) {
          c10::List<std::optional<at::Tensor>> ml, cl;
          for (const c10::IValue& e : v.toListRef()) {
            if (!e.isTensor()) {
              ml.push_back(std::nullopt);
              cl.push_back(std::nullopt);
              continue;
            }
            at::Tensor m, c;
            if (!tensor(e.toTensor(), written, m, c)) return false;
            ml.push_back(std::move(m));
            cl.push_back(std::move(c));
          }
          meta = std::move(ml);
          cpu = std::move(cl);
          return true;
        }
        break;
      case ArgKind::Generator:
        return false;  // not eligible; kept as a guard
      case ArgKind::Device:
        if (v.isDevice() && v.toDevice().type() == kOpenReg) {
          meta = c10::Device(c10::DeviceType::Meta);
          cpu = c10::Device(c10::DeviceType::CPU);
          return true;
        }
        break;
      default:
        break;
    }
    meta = v;
    cpu = v;
    return true;
  }

  // Device arguments the operator writes must keep their sizes, strides and storage: an
  // operator that would resize or restride one (out= of another shape, squeeze_) runs
  // synchronously.
  bool written_unchanged() const {
    for (const auto& t : tensors_) {
      if (!t.written) continue;
      const at::Tensor& m = t.meta;
      const at::Tensor& d = t.device;
      if (m.sizes() != d.sizes() || m.strides() != d.strides() ||
          m.storage_offset() != d.storage_offset() || m.dtype() != d.dtype() ||
          m.is_conj() != d.is_conj() || m.is_neg() != d.is_neg() ||
          !m.storage().is_alias_of(storages_[t.storage].meta) ||
          m.storage().nbytes() != d.storage().nbytes())
        return false;
    }
    return true;
  }

  // The device tensor the host returns for a meta output, or false if it cannot be made.
  bool output(const at::Tensor& m, size_t ret, int64_t item, at::Tensor& result,
              std::vector<QueuedKernel::Output>& fresh) {
    if (!m.defined()) {
      result = m;
      return true;
    }
    if (m.device().type() != c10::DeviceType::Meta || m.layout() != c10::kStrided) return false;
    for (const auto& t : tensors_)
      if (t.meta.unsafeGetTensorImpl() == m.unsafeGetTensorImpl()) {
        result = t.device;  // in-place and out= operators return their argument itself
        return true;
      }
    const auto* storage = m.storage().unsafeGetStorageImpl();
    for (const auto& st : storages_)
      if (st.meta.unsafeGetStorageImpl() == storage) {
        result = make_tensor_like(st.device, c10::DispatchKey::PrivateUse1, m);  // a view
        return true;
      }
    // Quantized, or a dtype the device profile refuses: the synchronous run raises its error.
    if (c10::isQIntType(m.scalar_type()) || profile_refuses(m.scalar_type())) return false;
    size_t index = 0;
    while (index < outputs_.size() && outputs_[index].meta.unsafeGetStorageImpl() != storage)
      ++index;
    if (index == outputs_.size()) {
      const size_t nbytes = m.storage().nbytes();
      c10::Storage device(c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), nbytes, allocate_on_device(device_, nbytes),
          allocator_for_device(device_), /*resizable=*/true));
      c10::Storage cpu = cpu_view_storage(device);
      outputs_.push_back({m.storage(), std::move(device), std::move(cpu)});
    }
    result = make_tensor_like(outputs_[index].device, c10::DispatchKey::PrivateUse1, m);
    fresh.push_back({ret, item, make_tensor_like(outputs_[index].cpu, c10::DispatchKey::CPU, m)});
    return true;
  }

  // ---- the signature cache (learned outputs, see below)
  // Where a device tensor returned by the synchronous run comes from, relative to this launch's
  // arguments: kind 1 = argument tensor `index`, 2 = view of argument storage `index`, 3 = fresh
  // storage `index` (numbered here, in order). Returns false for what cannot be replayed.
  struct Learned {
    int kind = 0;  // 0: undefined
    size_t index = 0;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    bool conj = false, neg = false;
    size_t nbytes = 0;  // fresh storage
  };
  bool learn(const at::Tensor& t, std::vector<const c10::StorageImpl*>& fresh, Learned& out) const {
    if (!t.defined()) return true;
    if (t.device().type() != kOpenReg || t.layout() != c10::kStrided) return false;
    out.sizes = t.sizes().vec();
    out.strides = t.strides().vec();
    out.offset = t.storage_offset();
    out.dtype = t.scalar_type();
    out.conj = t.is_conj();
    out.neg = t.is_neg();
    for (size_t i = 0; i < tensors_.size(); ++i)
      if (tensors_[i].device.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
        out.kind = 1;
        out.index = i;
        return true;
      }
    const auto* storage = t.storage().unsafeGetStorageImpl();
    for (size_t i = 0; i < storages_.size(); ++i)
      if (storages_[i].key == storage) {
        out.kind = 2;
        out.index = i;
        return true;
      }
    size_t f = 0;
    while (f < fresh.size() && fresh[f] != storage) ++f;
    if (f == fresh.size()) fresh.push_back(storage);
    out.kind = 3;
    out.index = f;
    out.nbytes = t.storage().nbytes();
    return true;
  }

  at::Tensor replay(const Learned& l, size_t ret, int64_t item,
                    std::vector<QueuedKernel::Output>& fresh) {
    if (l.kind == 0) return at::Tensor();
    if (l.kind == 1) return tensors_[l.index].device;
    auto like = [&](c10::Storage st, c10::DispatchKey key) {
      auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(st), c10::DispatchKeySet(key),
                                                        c10::scalarTypeToTypeMeta(l.dtype));
      t.unsafeGetTensorImpl()->set_sizes_and_strides(l.sizes, l.strides, l.offset);
      if (l.conj) t._set_conj(true);
      if (l.neg) t._set_neg(true);
      return t;
    };
    if (l.kind == 2) return like(storages_[l.index].device, c10::DispatchKey::PrivateUse1);
    while (replayed_.size() <= l.index) replayed_.emplace_back();
    auto& slot = replayed_[l.index];
    if (!slot.device) {
      slot.device = c10::Storage(c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), l.nbytes, allocate_on_device(device_, l.nbytes),
          allocator_for_device(device_), /*resizable=*/true));
      slot.cpu = cpu_view_storage(slot.device);
    }
    fresh.push_back({ret, item, like(slot.cpu, c10::DispatchKey::CPU)});
    return like(slot.device, c10::DispatchKey::PrivateUse1);
  }

  // Metadata of the written device arguments, to see whether a run changed them.
  std::vector<int64_t> written_state() const {
    std::vector<int64_t> state;
    for (const auto& t : tensors_) {
      if (!t.written) continue;
      state.insert(state.end(), t.device.sizes().begin(), t.device.sizes().end());
      state.insert(state.end(), t.device.strides().begin(), t.device.strides().end());
      state.push_back(t.device.storage_offset());
      state.push_back(int64_t(reinterpret_cast<uintptr_t>(t.device.storage().data())));
      state.push_back(int64_t(t.device.storage().nbytes()));
    }
    return state;
  }

 private:
  struct Replayed {
    c10::Storage device;
    c10::Storage cpu;
  };
  std::vector<Replayed> replayed_;

  struct StorageEntry {
    const c10::StorageImpl* key;
    c10::Storage device;
    c10::Storage meta;
    c10::Storage cpu;
  };
  struct TensorEntry {
    at::Tensor device;
    at::Tensor meta;
    at::Tensor cpu;
    size_t storage;
    bool written;
  };
  struct OutputStorage {
    c10::Storage meta;
    c10::Storage device;
    c10::Storage cpu;
  };

  bool tensor(const at::Tensor& t, bool written, at::Tensor& meta, at::Tensor& cpu) {
    if (!t.defined()) {
      meta = t;
      cpu = t;
      return true;
    }
    if (t.layout() != c10::kStrided) return false;
    if (t.device().type() == c10::DeviceType::CPU) {
      // A 0-dim CPU tensor (a scalar, DeviceCheck allowed nothing else): passed by value, as a
      // GPU kernel receives its scalar arguments at the launch.
      if (written) return false;
      if (with_meta_) {
        meta = make_tensor_like(meta_storage(t.storage().nbytes(), false), c10::DispatchKey::Meta, t);
        if (t.unsafeGetTensorImpl()->is_wrapped_number())
          meta.unsafeGetTensorImpl()->set_wrapped_number(true);
      }
      if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
        // Made from a Python number and never changed: the queued kernel gets its own
        // TensorImpl over the same memory (autograd may hand the original to Python, and a
        // stream worker must never release an object Python holds: that needs the GIL).
        cpu = make_tensor_like(t.storage(), c10::DispatchKey::CPU, t);
        cpu.unsafeGetTensorImpl()->set_wrapped_number(true);
      } else {
        cpu = t.clone();
      }
      return true;
    }
    if (t.device().type() != kOpenReg) return false;
    for (auto& e : tensors_)
      if (e.device.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
        e.written |= written;
        meta = e.meta;
        cpu = e.cpu;
        return true;
      }
    const c10::Storage& storage = t.storage();
    size_t index = 0;
    while (index < storages_.size() && storages_[index].key != storage.unsafeGetStorageImpl())
      ++index;
    if (index == storages_.size())
      storages_.push_back({storage.unsafeGetStorageImpl(), storage,
                           with_meta_ ? meta_storage(storage.nbytes(), storage.resizable())
                                      : c10::Storage(),
                           cpu_view_storage(storage)});
    if (with_meta_) meta = make_tensor_like(storages_[index].meta, c10::DispatchKey::Meta, t);
    cpu = make_tensor_like(storages_[index].cpu, c10::DispatchKey::CPU, t);
    tensors_.push_back({t, meta, cpu, index, written});
    return true;
  }

  const int device_;
  const bool with_meta_;
  c10::SmallVector<StorageEntry, 4> storages_;
  c10::SmallVector<TensorEntry, 4> tensors_;
  c10::SmallVector<OutputStorage, 2> outputs_;
};

}  // namespace

namespace {
// [docs:start ASYNC_SIGNATURES]
// The signature cache. The first call of every operator with a given signature (the operator,
// every tensor's dtype, sizes, strides, offset and which arguments share a storage, every other
// argument's value) runs synchronously: the CPU kernel itself checks the arguments, so what it
// refuses (a dtype it has no kernel for, an argument out of its range, overlapping memory) is
// raised at the call with the CPU's type and message, as CUDA refuses such launches on the host.
// For operators without a C++ meta kernel, that run also shows the outputs: their metadata and
// whether each is an argument, a view of an argument's storage or fresh memory; later calls with
// the same signature are queued, their outputs made from what was learned. Output shapes that
// depend on the data are excluded by the operator's tags (OpPlan). Operators whose outputs come
// from a meta function key a float argument by its kind only (its value does not change the
// outputs' metadata): an optimizer's changing step size does not make each step a new signature.
struct Learned {
  bool replayable = false;
  // The first call gave a warning. A GPU user sees an operator's warnings at the call (they come
  // from the host side of the operator, never from a running kernel): the calls of a signature
  // whose CPU kernel warns all run synchronously, so that each gives its warnings where it is made.
  bool warns = false;
  // For an operator whose outputs the C++ meta kernel describes (not replayed from `returns`):
  // whether that kernel gives the CPU kernel's sizes and strides, checked at the second call.
  // torch 2.14.1's meta kernel of native_group_norm makes a channels-last input's output
  // contiguous where the CPU kernel keeps channels-last: such a signature runs synchronously,
  // so its layout does not depend on the call's history (docs/determinism.md).
  enum class Meta { Unchecked, Agrees, Disagrees } meta = Meta::Unchecked;
  std::vector<std::vector<Launch::Learned>> returns;  // per return: one tensor or a list
  std::vector<bool> is_list;
};

// Whether the meta kernel's outputs have the sizes and strides the CPU kernel's had.
bool meta_agrees(const c10::Stack& meta, const Learned& cpu) {
  if (!cpu.replayable) return true;  // the first call recorded no outputs: nothing to compare
  if (meta.size() != cpu.returns.size()) return false;
  auto same = [](const c10::IValue& v, const Launch::Learned& l) {
    if (!v.isTensor()) return l.kind == 0;
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return l.kind == 0;
    return t.sizes().vec() == l.sizes && t.strides().vec() == l.strides;
  };
  for (size_t r = 0; r < meta.size(); ++r) {
    const auto& outs = cpu.returns[r];
    if (meta[r].isTensorList()) {
      const auto list = meta[r].toTensorList();
      if (list.size() != outs.size()) return false;
      for (size_t j = 0; j < outs.size(); ++j)
        if (!same(c10::IValue(list.get(j)), outs[j])) return false;
    } else if (meta[r].isNone()) {
      if (!outs.empty() && outs[0].kind != 0) return false;
    } else if (outs.size() != 1 || !same(meta[r], outs[0])) {
      return false;
    }
  }
  return true;
}

void put(std::string& key, int64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof v); }

// The signature of a call, or false if an argument cannot be part of one.
bool signature(const c10::OperatorHandle& op, const c10::Stack& stack, size_t first,
               size_t num_args, bool exact_floats, std::string& key) {
  c10::SmallVector<const c10::StorageImpl*, 8> storages;
  put(key, int64_t(reinterpret_cast<uintptr_t>(&op.schema())));
  auto tensor = [&](const at::Tensor& t) {
    if (!t.defined()) return put(key, -1);
    put(key, int64_t(t.device().type()) << 32 | int64_t(t.scalar_type()) << 8 | t.dim());
    for (int64_t v : t.sizes()) put(key, v);
    for (int64_t v : t.strides()) put(key, v);
    put(key, t.storage_offset());
    put(key, int64_t(t.is_conj()) | int64_t(t.is_neg()) << 1 |
                 int64_t(t.unsafeGetTensorImpl()->is_wrapped_number()) << 2 |
                 int64_t(t.layout() != c10::kStrided) << 3);
    const auto* impl = t.storage().unsafeGetStorageImpl();
    size_t g = 0;
    while (g < storages.size() && storages[g] != impl) ++g;
    if (g == storages.size()) storages.push_back(impl);
    put(key, int64_t(g));
    put(key, int64_t(t.storage().nbytes()));
  };
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& v = stack[first + i];
    // Each value is preceded by its kind: a Scalar argument may be an int, a float or a bool.
    if (v.isTensor()) {
      put(key, -11);
      tensor(v.toTensor());
    } else if (v.isTensorList()) {
      put(key, -12);
      auto list = v.toTensorList();
      put(key, int64_t(list.size()));
      for (const at::Tensor& t : list) tensor(t);
    } else if (v.isList() && v.toListRef().size() > 0 && v.toListRef()[0].isTensor()) {
      put(key, -13);
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) tensor(e.toTensor());
        else if (e.isNone()) put(key, -2);
        else return false;
      }
    } else if (v.isNone()) {
      put(key, -3);
    } else if (v.isInt()) {
      put(key, -14);
      put(key, v.toInt());
    } else if (v.isBool()) {
      put(key, -15);
      put(key, v.toBool());
    } else if (v.isDouble()) {
      put(key, -16);
      double d = exact_floats ? v.toDouble() : 0.0;
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      put(key, bits);
    } else if (v.isIntList()) {
      put(key, -17);
      for (int64_t e : v.toIntVector()) put(key, e);
      put(key, -4);
    } else if (v.isString()) {
      put(key, -18);
      key += v.toStringRef();
      put(key, -5);
    } else if (v.isDevice()) {
      put(key, -19);
      put(key, int64_t(v.toDevice().type()) << 8 | v.toDevice().index());
    } else if (v.isList()) {
      put(key, -20);
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isInt()) put(key, e.toInt());
        else if (e.isBool()) put(key, e.toBool() ? -21 : -22);
        else if (e.isDouble()) {
          double d = exact_floats ? e.toDouble() : 0.0;
          int64_t bits;
          std::memcpy(&bits, &d, sizeof bits);
          put(key, bits);
        } else if (e.isNone()) put(key, -6);
        else return false;
      }
      put(key, -7);
    } else {
      return false;  // complex scalars, dimnames, ...: not cached
    }
  }
  return true;
}

thread_local std::unordered_map<std::string, Learned> t_learned;
// Bounded in entries and in bytes (keys of tensor-list operators are long, and a float whose
// value changes at every call makes a new signature each time): past either, it starts over.
constexpr size_t kMaxLearned = 1 << 16;
constexpr size_t kMaxLearnedBytes = size_t(64) << 20;
thread_local size_t t_learned_bytes = 0;
// Set while the fallback runs an operator synchronously to learn its outputs.
thread_local bool t_learning = false;
// [docs:end ASYNC_SIGNATURES]

enum class Route { Queued, Wrapper, Synchronous };

// The first call of a signature: runs the operator synchronously (the fallback's default path)
// and records its outputs relative to its arguments.
void learn_synchronously(const c10::OperatorHandle& op, c10::Stack* stack, int device,
                         const ArgSummary& s, std::string key) {
  const size_t num_args = s.kinds.size();
  const size_t first = stack->size() - num_args;
  Launch launch(device, /*with_meta=*/false);
  bool replayable = true;
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue meta, cpu;
    if (!launch.convert((*stack)[first + i], s.kinds[i], s.writes[i], meta, cpu))
      replayable = false;
  }
  const auto before = launch.written_state();
  // The warnings go where they would go anyway (Python's warnings): this only notes them.
  struct NoteWarnings : c10::WarningHandler {
    c10::WarningHandler* next = c10::WarningUtils::get_warning_handler();
    bool warned = false;
    void process(const c10::Warning& w) override {
      warned = true;
      next->process(w);
    }
  } note;
  {
    struct Reset {
      ~Reset() { t_learning = false; }
    } reset;
    t_learning = true;
    c10::WarningUtils::WarningHandlerGuard noting(&note);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
  }
  // Errors of the CPU kernel propagated above, with its type and message: nothing is learned.
  Learned learned;
  const size_t num_returns = op.schema().returns().size();
  std::vector<const c10::StorageImpl*> fresh;
  for (size_t r = 0; r < num_returns && replayable; ++r) {
    const c10::IValue& v = (*stack)[stack->size() - num_returns + r];
    learned.returns.emplace_back();
    learned.is_list.push_back(v.isTensorList());
    if (v.isTensor()) {
      learned.returns.back().emplace_back();
      replayable = launch.learn(v.toTensor(), fresh, learned.returns.back().back());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        learned.returns.back().emplace_back();
        replayable = replayable && launch.learn(t, fresh, learned.returns.back().back());
      }
    } else if (!v.isNone()) {
      replayable = false;
    }
  }
  // An operator that resized or moved a written argument cannot be replayed from its metadata.
  learned.replayable = replayable && launch.written_state() == before;
  learned.warns = note.warned;
  size_t bytes = key.size() + sizeof(Learned);
  for (const auto& outs : learned.returns)
    for (const auto& out : outs)
      bytes += sizeof(out) + (out.sizes.size() + out.strides.size()) * sizeof(int64_t);
  if (t_learned.size() >= kMaxLearned || t_learned_bytes + bytes > kMaxLearnedBytes) {
    t_learned.clear();
    t_learned_bytes = 0;
  }
  t_learned_bytes += bytes;
  t_learned.emplace(std::move(key), std::move(learned));
}

// [docs:start ASYNC_FALLBACK]
Route try_queue(const c10::OperatorHandle& op, c10::Stack* stack, int device,
                const ArgSummary& s) {
  if (inside_stream_work() || t_learning) return Route::Synchronous;
  const OpPlan& plan = plan_for(op, s);
  const bool checked = std::exchange(t_checked_by_wrapper, false);
  if (!plan.eligible) return Route::Synchronous;
  const size_t num_args = s.kinds.size();
  const size_t first = stack->size() - num_args;
  const Learned* learned = nullptr;
  Learned* check_meta = nullptr;  // a signature whose meta kernel is compared at this call
  // The `.out` call of a structured wrapper was checked with the wrapper's own call.
  if (!checked || !plan.returns_written_args) {
    const bool replay = !plan.structured_wrapper && !plan.cpp_meta;
    // Built in a buffer kept by the thread: no allocation for a signature seen before.
    thread_local std::string key;
    key.clear();
    if (!signature(op, *stack, first, num_args, /*exact_floats=*/replay, key))
      return Route::Synchronous;
    auto it = t_learned.find(key);
    if (it == t_learned.end()) {
      learn_synchronously(op, stack, device, s, key);
      return Route::Wrapper;  // ran (synchronously), not counted as queued
    }
    if (it->second.warns) return Route::Synchronous;
    if (replay) {
      if (!it->second.replayable) return Route::Synchronous;
      learned = &it->second;
    } else if (it->second.meta == Learned::Meta::Disagrees) {
      return Route::Synchronous;
    } else if (it->second.meta == Learned::Meta::Unchecked && !plan.structured_wrapper) {
      check_meta = &it->second;
    }
  }
  if (plan.structured_wrapper) {
    // The wrapper runs here, on device tensors: its C++ meta function checks the arguments (the
    // CPU's errors, raised now) and its outputs are allocated on the device; the `.out` call it
    // makes comes back to the fallback and is queued below without a meta kernel.
    struct Reset {
      ~Reset() { t_checked_by_wrapper = false; }
    } reset;
    t_checked_by_wrapper = true;
    // The profiler shows the operator once, as in the default mode (not also its `.out` call).
    at::DisableRecordFunctionGuard one_event;
    op.redispatchBoxed(c10::DispatchKeySet(kWrapperKey), stack);
    return Route::Wrapper;
  }
  const size_t num_returns = op.schema().returns().size();
  const bool with_meta = !(checked && plan.returns_written_args) && learned == nullptr;

  // 1. Meta and CPU forms of the arguments (device tensors sharing a storage share one).
  Launch launch(device, with_meta);
  c10::Stack meta_stack(num_args);
  auto kernel = std::make_shared<QueuedKernel>(QueuedKernel{op, {}, {}});
  kernel->args.resize(num_args);
  for (size_t i = 0; i < num_args; ++i)
    if (!launch.convert((*stack)[first + i], s.kinds[i], s.writes[i], meta_stack[i],
                        kernel->args[i]))
      return Route::Synchronous;

  c10::SmallVector<c10::IValue, 2> results(num_returns);
  WarningBuffer warnings;
  if (learned != nullptr) {
    // A signature seen before: the outputs as the synchronous run made them.
    for (size_t r = 0; r < num_returns; ++r) {
      const auto& outs = learned->returns[r];
      if (!learned->is_list[r]) {
        results[r] = outs.empty() ? c10::IValue() : c10::IValue(launch.replay(outs[0], r, -1, kernel->fresh));
        continue;
      }
      c10::List<at::Tensor> list;
      for (size_t j = 0; j < outs.size(); ++j)
        list.push_back(launch.replay(outs[j], r, int64_t(j), kernel->fresh));
      results[r] = std::move(list);
    }
  } else if (!with_meta) {
    // Checked by the wrapper: the results are the arguments written in place.
    for (size_t r = 0; r < num_returns; ++r) results[r] = (*stack)[first + plan.returned_arg[r]];
  } else {
    // 2. The meta kernel checks the arguments and gives the outputs' metadata. If it refuses
    //    them (or does not exist), the CPU kernel runs synchronously and raises the CPU's own
    //    error.
    try {
      c10::WarningUtils::WarningHandlerGuard hold_back(&warnings);
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &meta_stack);
    } catch (const std::exception&) {
      return Route::Synchronous;
    }
    if (!launch.written_unchanged()) return Route::Synchronous;
    if (check_meta != nullptr) {
      const bool agrees = meta_agrees(meta_stack, *check_meta);
      check_meta->meta = agrees ? Learned::Meta::Agrees : Learned::Meta::Disagrees;
      if (!agrees) return Route::Synchronous;
    }

    // 3. Device outputs: arguments, views of arguments' storages, or fresh memory allocated now
    //    on the current stream.
    TORCH_INTERNAL_ASSERT(meta_stack.size() == num_returns);
    for (size_t r = 0; r < num_returns; ++r) {
      const c10::IValue& v = meta_stack[r];
      if (v.isNone()) continue;
      if (v.isTensor()) {
        at::Tensor out;
        if (!launch.output(v.toTensor(), r, -1, out, kernel->fresh)) return Route::Synchronous;
        results[r] = std::move(out);
      } else if (v.isTensorList()) {
        c10::List<at::Tensor> list;
        auto metas = v.toTensorList();
        for (size_t j = 0; j < metas.size(); ++j) {
          at::Tensor out;
          if (!launch.output(metas.get(j), r, int64_t(j), out, kernel->fresh))
            return Route::Synchronous;
          list.push_back(std::move(out));
        }
        results[r] = std::move(list);
      } else {
        return Route::Synchronous;
      }
    }
  }

  // 4. Queue the CPU kernel behind the work issued on the stream so far, and return.
  Stream* stream = current_stream(device);
  const int64_t id = stream_id(stream);
  queue(stream, ActivityKind::Kernel, 0, [kernel, device, id] { run_queued(*kernel, device, id); });
  for (const c10::Warning& w : warnings.warnings) c10::warn(w);
  torch::jit::drop(*stack, num_args);
  for (auto& r : results) stack->push_back(std::move(r));
  return Route::Queued;
}
// [docs:end ASYNC_FALLBACK]
}  // namespace

// [docs:start ASYNC_DEVICE_COPY]
bool async_device_copy(const at::Tensor& dst, const at::Tensor& src) {
  if (inside_stream_work() || dst.layout() != c10::kStrided || src.layout() != c10::kStrided ||
      is_cow(dst))  // materialized by the synchronous copy (ops/cow.h)
    return false;
  const int device = dst.device().index();
  auto view = [](const at::Tensor& t, const at::Tensor* other, const at::Tensor* other_view) {
    if (other != nullptr && t.storage().is_alias_of(other->storage()))
      return make_tensor_like(other_view->storage(), c10::DispatchKey::CPU, t);  // overlapping views
    return make_tensor_like(cpu_view_storage(t.storage()), c10::DispatchKey::CPU, t);
  };
  at::Tensor d = view(dst, nullptr, nullptr);
  at::Tensor s = view(src, &dst, &d);
  queue(current_stream(device), ActivityKind::CopyDtoD, size_t(dst.numel()) * dst.element_size(),
        [d, s] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    KernelScope memory;
    d.copy_(s);
  });
  g_queued.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool async_fill(const at::Tensor& self, const c10::Scalar& value, bool memset) {
  // A copy-on-write destination: the synchronous fill materializes it (ops/cow.h).
  if (inside_stream_work() || self.layout() != c10::kStrided || is_cow(self)) return false;
  // The value is converted now, on the host (a value the dtype cannot hold raises the CPU's
  // error at the call, as CUDA converts a kernel's scalar arguments at the launch).
  at::empty({}, at::TensorOptions().dtype(self.scalar_type())).fill_(value);
  at::Tensor view = make_tensor_like(cpu_view_storage(self.storage()), c10::DispatchKey::CPU, self);
  queue(current_stream(self.device().index()), memset ? ActivityKind::Memset : ActivityKind::Kernel,
        memset ? size_t(self.numel()) * self.element_size() : 0, [view, value] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    KernelScope memory;
    view.fill_(value);
  });
  g_queued.fetch_add(1, std::memory_order_relaxed);
  return true;
}
// [docs:end ASYNC_DEVICE_COPY]

bool async_fallback(const c10::OperatorHandle& op, c10::Stack* stack, int device,
                    const ArgSummary& s) {
  // A written copy-on-write storage is materialized by the synchronous run, in stream order
  // (ops/cow.h): a copy made now would miss the writes still queued.
  const Route route = writes_cow(s, *stack, stack->size() - s.kinds.size())
                          ? Route::Synchronous
                          : try_queue(op, stack, device, s);
  if (route == Route::Queued) g_queued.fetch_add(1, std::memory_order_relaxed);
  if (route == Route::Synchronous) g_synchronous.fetch_add(1, std::memory_order_relaxed);
  return route != Route::Synchronous;
}

}  // namespace openreg
