// Native because: the generic fallback is the per-operator hot path (measured ~3 us per op in
// C++ against ~13 us for the same fallback in Python, ../shared/DESIGN.md).
//
// Every aten operator without an openreg kernel of its own lands here. Its CPU kernel runs on the
// device memory itself: device tensors are replaced by CPU aliases of the same memory, the CPU
// kernel is called, and what it returns becomes device tensors again without copies (see
// ops/cpu_kernel.h). The fallback also enforces what a real device would: all tensors on the same
// device, random numbers from the device's generator, stream order.
#include "ops/fallback.h"

#include "adapters/generator.h"
#include "adapters/graph.h"
#include "ops/async_kernel.h"
#include "ops/cow.h"
#include "ops/cpu_kernel.h"
#include "runtime/device.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <torch/library.h>

#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

namespace openreg {
namespace {

constexpr auto kOpenReg = c10::DeviceType::PrivateUse1;

ArgKind kind_of(const c10::TypePtr& type) {
  const c10::Type* t = type.get();
  if (t->kind() == c10::TypeKind::OptionalType)
    t = t->castRaw<c10::OptionalType>()->getElementType().get();
  switch (t->kind()) {
    case c10::TypeKind::TensorType:
      return ArgKind::Tensor;
    case c10::TypeKind::GeneratorType:
      return ArgKind::Generator;
    case c10::TypeKind::DeviceObjType:
      return ArgKind::Device;
    case c10::TypeKind::ListType: {
      const auto& elem = t->castRaw<c10::ListType>()->getElementType();
      if (elem->kind() == c10::TypeKind::TensorType) return ArgKind::TensorList;
      if (elem->kind() == c10::TypeKind::OptionalType &&
          elem->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType)
        return ArgKind::OptionalTensorList;
      return ArgKind::Other;
    }
    default:
      return ArgKind::Other;
  }
}

// Finds the operator's device and rejects tensors a real device could not use together.
struct DeviceCheck {
  const c10::OperatorHandle& op;
  const ArgSummary& s;
  int device = -1;
  const at::Tensor* host_tensor = nullptr;

  void visit(const at::Tensor& t, bool written) {
    if (!t.defined()) return;
    auto type = t.device().type();
    if (type == kOpenReg) {
      int index = t.device().index();
      if (device < 0) device = index;
      else
        TORCH_CHECK(index == device,
                    "Expected all tensors to be on the same device, but found at least two "
                    "devices, openreg:", device, " and openreg:", index, "! (in ",
                    op.schema().name(), ")");
    } else if (type == c10::DeviceType::CPU) {
      // A 0-dim CPU tensor is a scalar (allowed for inputs, as on CUDA).
      if ((t.dim() != 0 || written) && !s.cpu_tensors_allowed && host_tensor == nullptr)
        host_tensor = &t;
    } else {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found a tensor on ",
                  t.device(), " in a call of ", op.schema().name(), " on openreg");
    }
  }

  void finish(const c10::Stack& stack, size_t first) {
    if (device < 0) {
      // No device tensor: a factory with device=openreg[:i].
      bool openreg_generator = false;
      for (size_t i = 0; i < s.kinds.size(); ++i) {
        const auto& v = stack[first + i];
        if (s.kinds[i] == ArgKind::Device && v.isDevice() && v.toDevice().type() == kOpenReg) {
          auto d = v.toDevice();
          device = d.has_index() ? d.index() : current_device();
        }
        if (s.kinds[i] == ArgKind::Generator && v.isGenerator() &&
            v.toGenerator().device().type() == kOpenReg)
          openreg_generator = true;
      }
      // [docs:start FALLBACK_CPU_OP_OPENREG_GENERATOR]
      // Only the generator brought the call here: a CPU operator given an openreg generator.
      TORCH_CHECK(device >= 0 || !openreg_generator,
                  "Expected a 'cpu' device type for generator but found 'openreg' (in ",
                  op.schema().name(), " on cpu tensors)");
      // [docs:end FALLBACK_CPU_OP_OPENREG_GENERATOR]
      if (device < 0) device = current_device();
    }
    check_device(device);
    TORCH_CHECK(host_tensor == nullptr,
                "Expected all tensors to be on the same device, but found at least two devices, "
                "openreg:", device, " and cpu! (in ", op.schema().name(), ")");
  }
};


// [docs:start STRIDED_RESULTS]
// The fallback can only give back strided tensors: a kernel returning another layout (sparse
// conversions) gets a clear error instead of one about a storage the layout does not have.
void check_strided_result(const at::Tensor& t, const c10::OperatorHandle& op) {
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == c10::kStrided, "openreg supports only strided tensors, "
                              "but ", op.schema().operator_name(), " returns a tensor with layout ",
                              t.layout());
}
// [docs:end STRIDED_RESULTS]

// [docs:start QUANTIZED_REFUSED]
// Quantized tensors (deprecated in torch 2.13) are not supported: the CPU kernel of
// quantize_per_tensor would hand back a tensor whose dtype says quint8 but which is not quantized.
// Such results are refused naming the operator and the dtype, and so is every operator reaching
// openreg's quantized key (a quantized dtype asked of a factory, `.to(torch.quint8)`, ...).
constexpr const char* kQuantizedHint =
    " (quantized tensors are deprecated in torch 2.13; keep quantized work on the CPU)";

void check_representable_dtype(const at::Tensor& t, const c10::OperatorHandle& op) {
  TORCH_CHECK_NOT_IMPLEMENTED(!c10::isQIntType(t.scalar_type()),
                              "openreg does not support quantized tensors, but ",
                              op.schema().operator_name(), " returns a tensor of dtype ",
                              t.scalar_type(), kQuantizedHint);
}

void refuse_quantized(const c10::OperatorHandle& op, c10::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "openreg does not support quantized tensors (",
                              op.schema().operator_name(), " was called with a quantized dtype or "
                              "a quantized tensor)", kQuantizedHint);
}
// [docs:end QUANTIZED_REFUSED]

void fallback(const c10::OperatorHandle& op, c10::Stack* stack) {
  const ArgSummary& s = arg_summary(op);
  const size_t num_args = s.kinds.size();
  const size_t first = stack->size() - num_args;

  DeviceCheck check{op, s};
  for (size_t i = 0; i < num_args; ++i)
    for_each_tensor((*stack)[first + i], s.kinds[i],
                    [&](const at::Tensor& t) { check.visit(t, s.writes[i]); });
  check.finish(*stack, first);
  const int device = check.device;
  // [docs:start FALLBACK_CAPTURE]
  // A stream capturing a graph records the operator instead of running it (adapters/graph.cpp).
  if (Capture* capture = capturing(device))
    return capture_op(capture, op, stack, device, ReplayOn::Cpu);
  // [docs:end FALLBACK_CAPTURE]
  // [docs:start FALLBACK_ASYNC]
  // Asynchronous kernel mode (ops/async_kernel.h, docs/async_mode.md): the kernel is queued on
  // the stream and the results are returned at once. What it cannot queue runs below as usual,
  // in stream order (the HostKernel's LaunchScope waits for the queued work).
  if (async_kernels_enabled() && async_fallback(op, stack, device, s)) return;
  // [docs:end FALLBACK_ASYNC]

  HostKernel kernel(device);
  // Keep the device arguments written in place: they are synchronised after the kernel.
  c10::SmallVector<c10::IValue, 2> written;
  if (s.any_writes)
    for (size_t i = 0; i < num_args; ++i)
      if (s.writes[i]) written.push_back((*stack)[first + i]);
  // [docs:start FALLBACK_COW]
  // A written argument sharing its memory with a lazy clone gets its own copy first, in stream
  // order (ops/cow.h): the kernel writes through an alias, which cannot do it.
  materialize_written(s, *stack, first);
  // [docs:end FALLBACK_COW]
  auto to_cpu = [&](const at::Tensor& t) {
    return t.defined() && t.device().type() == kOpenReg ? kernel.alias(t) : t;
  };
  // Device tensors become CPU aliases, generators the CPU ones inside the device's (fallback.h).
  arguments_to_cpu(*stack, first, s, device, to_cpu);

  // Arguments written in place (including out= arguments a kernel resized) keep their device
  // tensor; carry over any change of size or memory. Also when the kernel fails: the CPU's
  // kernels may resize an out= argument before they refuse its dtype, and the device tensor
  // must be left as the CPU's would be.
  auto sync_written = [&] {
    for (const c10::IValue& v : written) {
      if (v.isTensor()) kernel.sync_written(v.toTensor());
      else if (v.isTensorList())
        for (const at::Tensor& t : v.toTensorList()) kernel.sync_written(t);
    }
  };

  // [docs:start ERROR_CONTEXT]
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  } catch (c10::NotImplementedError& e) {
    if (!op.hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
        !op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, "The operator '", op.schema().operator_name(),
                                  "' is not implemented for the openreg device: it has no "
                                  "openreg kernel and no CPU kernel for the fallback to run.");
    }
    sync_written();
    add_error_context(e, op, device);
    throw;
  } catch (c10::Error& e) {
    // The CPU kernel's own error: `throw;` keeps the exception's type (IndexError, ValueError,
    // TypeError, ...) and message; the context is added only if OPENREG_ERROR_CONTEXT=1.
    sync_written();
    add_error_context(e, op, device);
    throw;
  }
  // [docs:end ERROR_CONTEXT]
  sync_written();

  // Returns: CPU tensors back to device tensors.
  const size_t num_returns = op.schema().returns().size();
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    // Each result is moved out of the stack, so that a fresh one can become the device tensor
    // in place (HostKernel::result).
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && t.is_cpu()) {
        check_strided_result(t, op);
        check_representable_dtype(t, op);
        v = kernel.result(std::move(v).toTensor());
      }
    } else if (v.isTensorList()) {
      auto list = std::move(v).toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(list.size());
      for (size_t j = 0; j < list.size(); ++j) {
        at::Tensor t = list.extract(j);
        if (t.defined() && t.is_cpu()) {
          check_strided_result(t, op);
          check_representable_dtype(t, op);
          out.push_back(kernel.result(std::move(t)));
        } else {
          out.push_back(std::move(t));
        }
      }
      v = std::move(out);
    }
  }
}

}  // namespace

const ArgSummary& arg_summary(const c10::OperatorHandle& op) {
  // Per thread (no lock), in an open-addressing table (one probe for most calls); the summaries
  // do not move when the table grows, since a caller may hold one while a nested call adds one.
  thread_local ska::flat_hash_map<const c10::FunctionSchema*, std::unique_ptr<ArgSummary>> cache;
  const auto& schema = op.schema();
  auto it = cache.find(&schema);
  if (it != cache.end()) return *it->second;
  ArgSummary s;
  for (const auto& arg : schema.arguments()) {
    s.kinds.push_back(kind_of(arg.type()));
    s.writes.push_back(arg.alias_info() != nullptr && arg.alias_info()->isWrite());
    s.any_writes |= s.writes.back();
    s.has_generator |= s.kinds.back() == ArgKind::Generator;
  }
  const auto& name = schema.name();
  s.cpu_tensors_allowed = name == "aten::index" || name == "aten::index_put_" ||
                          name == "aten::_index_put_impl_" || name == "aten::index_put" ||
                          name == "aten::_unsafe_index" || name == "aten::_unsafe_index_put";
  find_running_stats(schema, s);  // copy-on-write (ops/cow.h)
  return *cache.emplace(&schema, std::make_unique<ArgSummary>(std::move(s))).first->second;
}

// [docs:start ERROR_CONTEXT_SWITCH]
// Errors of CPU kernels reach the user unchanged: the CPU's exception type and message, which
// device-generic test suites compare across devices. OPENREG_ERROR_CONTEXT=1 (read once, when
// torch_openreg._C loads) appends where the error came from, for people debugging the backend:
// "... (while running aten::mm on openreg:0 with its CPU kernel)".
static const bool error_context_enabled = [] {
  const char* env = std::getenv("OPENREG_ERROR_CONTEXT");
  return env != nullptr && env[0] != '\0' && std::string_view(env) != "0";
}();

void add_error_context(c10::Error& e, const c10::OperatorHandle& op, int device,
                       const char* layout) {
  if (!error_context_enabled) return;
  if (layout == nullptr)
    e.add_context(c10::str("while running ", op.schema().operator_name(), " on openreg:", device,
                           " with its CPU kernel"));
  else
    e.add_context(c10::str("while running ", op.schema().operator_name(), " on openreg:", device,
                           " (layout ", layout, ") with its CPU kernel"));
}
// [docs:end ERROR_CONTEXT_SWITCH]

void generic_fallback(const c10::OperatorHandle& op, c10::Stack* stack) { fallback(op, stack); }

// Operators whose PrivateUse1 slot PyTorch fills with a composite kernel (structured operators'
// functional and in-place wrappers, foreach operators) although a CPU kernel does the job in one
// call: through the composite, `mul` would allocate its output and run its meta function, then run
// the CPU `mul.out` kernel, which runs the meta function again; a foreach operator would reach the
// fallback once per tensor. Registering the fallback for them directly runs the CPU kernel once.
// Done when the Python module loads, after every static registration of the process.
// [docs:start REJECTS_OTHER_DEVICES]
// Composite kernels that work only for the devices PyTorch names (found by
// tests/test_op_conformance.py): mode.values checks for CPU, CUDA and XPU; conj_physical_ calls
// a device kernel table (DispatchStub) directly, which has no openreg entry. Run on CPU aliases
// by the fallback, they work.
bool rejects_other_devices(const std::string& name) {
  return name == "mode.values" || name == "conj_physical_";
}
// [docs:end REJECTS_OTHER_DEVICES]

void route_composites_to_fallback() {
  auto& dispatcher = c10::Dispatcher::singleton();
  static auto* library = new torch::Library(torch::Library::IMPL, "aten",
                                            c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    const bool composite =
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd);
    const bool foreach = std::string_view(name.name).rfind("aten::_foreach_", 0) == 0;
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    if (composite && rejects_other_devices(full)) {
      library->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
      continue;
    }
    if (!composite || !(foreach || op->hasKernelForDispatchKey(c10::DispatchKey::CPU))) continue;
    library->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

// [docs:start FALLBACK_GLOBAL]
TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}
// [docs:end FALLBACK_GLOBAL]

TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&refuse_quantized>());
}

}  // namespace openreg
