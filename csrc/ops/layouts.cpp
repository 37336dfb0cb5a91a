// Native because: sparse and nested tensors are C++ TensorImpls (SparseTensorImpl,
// SparseCsrTensorImpl, NestedTensorImpl) whose members only C++ can alias, and this fallback is
// the per-operator path of every sparse and nested operator.
//
// Sparse (COO), sparse compressed (CSR, CSC, BSR, BSC) and strided nested tensors on openreg.
//
// A sparse or nested tensor is a few dense tensors plus metadata: COO has `indices` and `values`;
// the compressed layouts have compressed indices, plain indices and `values`; a nested tensor has
// one buffer (a storage) plus CPU metadata (nested sizes, strides and offsets). On openreg those
// dense parts live in device memory, as on CUDA. Operators on these layouts dispatch to keys the
// dense fallback never sees (SparsePrivateUse1, SparseCsrPrivateUse1, NestedTensorPrivateUse1).
// They all land in one boxed fallback here, which does what the dense fallback does, one level
// up: every openreg tensor becomes a CPU tensor of the same layout whose dense parts are CPU
// aliases of the device memory (no copy), the operator runs its CPU kernel, and results become
// openreg tensors of the same layout whose dense parts are device memory (ops/cpu_kernel.h).
#include "adapters/generator.h"
#include "ops/cow.h"
#include "ops/cpu_kernel.h"
#include "ops/fallback.h"
#include "routes/call_counter.h"
#include "runtime/device.h"

#include <ATen/NestedTensorImpl.h>
#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_to_dense_ops.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/values_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace openreg {
namespace {

constexpr auto kOpenReg = c10::DeviceType::PrivateUse1;

// CSR, CSC, BSR, BSC (Tensor::is_sparse_csr() is true for CSR only).
bool is_compressed(const at::Tensor& t) {
  return t.key_set().has_all(c10::DispatchKeySet(c10::DispatchKey::SparseCsr));
}

bool is_layout_tensor(const at::Tensor& t) {
  return t.is_sparse() || is_compressed(t) || t.is_nested();
}

const char* layout_name(const at::Tensor& t) {
  if (t.is_nested()) return "nested (strided)";
  switch (t.layout()) {
    case c10::kSparse: return "sparse_coo";
    case c10::kSparseCsr: return "sparse_csr";
    case c10::kSparseCsc: return "sparse_csc";
    case c10::kSparseBsr: return "sparse_bsr";
    case c10::kSparseBsc: return "sparse_bsc";
    case c10::kStrided: return "strided";
    default: return "unknown";
  }
}

// A strided tensor over the whole of `storage`, one element per item of `dtype` (the buffer of a
// nested tensor).
at::Tensor flat_over(c10::Storage storage, c10::DispatchKey key, caffe2::TypeMeta dtype) {
  const int64_t n = static_cast<int64_t>(storage.nbytes() / dtype.itemsize());
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                    dtype);
  t.unsafeGetTensorImpl()->set_sizes_contiguous({n});
  return t;
}

// [docs:start HOST_METADATA]
// Nested metadata (sizes, strides, offsets) is CPU data, read by host code. A CPU kernel that
// makes new metadata allocates it inside the kernel session, from device memory (the session
// redirects CPU allocations): copy such tensors to host memory before they leave the session.
at::Tensor host_metadata(const at::Tensor& t) {
  if (!t.defined() || !t.is_cpu() || !t.has_storage() ||
      !is_device_memory(t.storage().data_ptr()))
    return t;
  AllocateOnDevice host(-1);  // plain CPU allocations again
  return t.clone();
}
// [docs:end HOST_METADATA]

// A TensorImpl's device, which TensorImpl sets only when it is built (a SparseTensorImpl has no
// storage for set_storage_keep_dtype to take it from).
struct SparseDevice : c10::TensorImpl {
  static constexpr auto device_opt() { return &SparseDevice::device_opt_; }
};

// Calls that reused a twin's shell and results made device tensors in place, for tests
// (`_route_calls("layouts.twin_shell")`, `"layouts.result_in_place"` for COO results,
// `"layouts.dense_result_in_place"` for strided ones).
std::atomic<int64_t>& g_twin_shells = call_counter("layouts.twin_shell");
std::atomic<int64_t>& g_sparse_results_in_place = call_counter("layouts.result_in_place");
std::atomic<int64_t>& g_dense_results_in_place = call_counter("layouts.dense_result_in_place");

// [docs:start TWIN_SHELLS]
// The SparseTensorImpl of a COO twin outlives its call, empty: at the end of the call, if nothing
// else holds it, it lets go of its members (the aliases, which must not outlive the call) and
// waits in this thread's pool for the next twin of its dtype. A new SparseTensorImpl's constructor
// allocates two empty members through the dispatcher only to have them replaced (about 3,500
// instructions of a twin's 6,600, callgrind, issue 41). The shell gets its shape, members and flag
// anew from each device tensor it stands for (raw_resize_ for the shape, SET_MEMBERS for the rest).
thread_local c10::SmallVector<at::Tensor, 4> t_twin_shells;

at::Tensor twin_shell(caffe2::TypeMeta dtype) {
  for (size_t i = 0; i < t_twin_shells.size(); ++i)
    if (t_twin_shells[i].dtype() == dtype) {
      at::Tensor shell = std::move(t_twin_shells[i]);
      t_twin_shells.erase(t_twin_shells.begin() + i);
      g_twin_shells.fetch_add(1, std::memory_order_relaxed);
      return shell;
    }
  return at::detail::make_tensor<at::SparseTensorImpl>(
      c10::DispatchKeySet(c10::DispatchKey::SparseCPU), dtype);
}

// The keys of a CPU SparseTensorImpl as its constructor sets them (SparseCPU, with the CPU's
// autograd and autocast keys).
c10::DispatchKeySet cpu_sparse_keys() {
  static const c10::DispatchKeySet keys =
      at::detail::make_tensor<at::SparseTensorImpl>(
          c10::DispatchKeySet(c10::DispatchKey::SparseCPU), caffe2::TypeMeta::Make<float>())
          .key_set();
  return keys;
}

// A CPU SparseTensorImpl only this handle holds, as its constructor made it (keys, no autograd
// metadata, no Python object, metadata unlocked, no math bits): what a twin's shell may be reused
// from and what a result may become the device tensor in place from.
bool unshared_plain_cpu_sparse(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return t.use_count() == 1 && t.weak_use_count() == 1 &&
         typeid(*impl) == typeid(at::SparseTensorImpl) && impl->key_set() == cpu_sparse_keys() &&
         impl->autograd_meta() == nullptr && impl->pyobj_slot()->load_pyobj() == nullptr &&
         impl->allow_tensor_metadata_change();
}

void return_shell(at::Tensor&& twin) {
  // Kept by the kernel (a result, a failing kernel's stack) or changed beyond what a twin sets
  // (math bits, metadata locked): it goes, as every twin went before.
  if (!unshared_plain_cpu_sparse(twin) || t_twin_shells.size() >= 4) return;
  // its members only: a twin has no storage or autograd metadata
  twin.unsafeGetTensorImpl()->release_resources();
  t_twin_shells.push_back(std::move(twin));
}
// [docs:end TWIN_SHELLS]

// [docs:start SET_MEMBERS]
// The members of a SparseTensorImpl whose invariants are already known: the aliases of a device
// tensor's members in a twin of its shape, or a result's own members, moved to the device, back
// in it. `set_indices_and_values_unsafe` would check again what its earlier call checked (layouts,
// devices, dtypes, dimensions, the values' sizes, through a vector of SymInts: about 1,000
// instructions per call, callgrind, issue 41); the members and the flag are public fields of
// SparseTensorImpl (torch 2.13-2.15), assigned here as that setter assigns them.
void set_members(at::SparseTensorImpl* impl, at::Tensor indices, at::Tensor values,
                 bool coalesced) {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(impl->allow_tensor_metadata_change() &&
                                   indices.device() == impl->device() &&
                                   values.device() == impl->device() &&
                                   values.dtype() == impl->dtype() &&
                                   indices.dim() == 2 && indices.size(0) == impl->sparse_dim() &&
                                   values.dim() == impl->dense_dim() + 1 &&
                                   indices.size(1) == values.size(0));
  impl->indices_ = std::move(indices);
  impl->values_ = std::move(values);
  impl->coalesced_ = coalesced;
}
// [docs:end SET_MEMBERS]

// One operator call: the CPU twin of each openreg tensor argument (same layout, dense parts
// aliasing device memory), and the openreg tensor of each CPU result.
class LayoutSession {
 public:
  // `caller_holds_arguments`: every device tensor passed to to_cpu outlives the session (an
  // unboxed kernel's arguments, LAYOUT_ROUTE), so the session borrows them instead of taking a
  // reference (for a tensor Python holds, a reference taken and dropped also takes and drops one
  // on its Python object, under the GIL: about 1,000 instructions per tensor, callgrind).
  // `memo_site`: a call site's memo of the tensors it aliased last (HostKernel, ALIAS_MEMO), for
  // a site that passes the same tensors call after call (a loop on one sparse tensor).
  explicit LayoutSession(int device, bool caller_holds_arguments = false, int memo_site = -1)
      : kernel_(device, memo_site), device_(device), borrow_(caller_holds_arguments) {
    if (borrow_) kernel_.caller_holds_arguments();
  }
  // The twins' shells go back to this thread's pool (before kernel_ ends: their members, the
  // aliases, must be released first, see HostKernel's ALIAS_CACHE_RETURN).
  ~LayoutSession() {
    for (Twin& p : twins_) {
      if (p.cpu.is_sparse()) return_shell(std::move(p.cpu));
      if (borrow_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(p.device);
    }
  }

  at::Tensor to_cpu(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != kOpenReg) return t;
    if (!is_layout_tensor(t)) return kernel_.alias(t);
    for (auto& p : twins_)
      if (p.device.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return p.cpu;
    at::Tensor cpu;
    // [docs:start COO_TWIN]
    if (t.is_sparse()) {
      // COO: indices and values, the CPU kernel's own SparseTensorImpl around their aliases (a
      // shell of an earlier call's twin when one is free: TWIN_SHELLS).
      auto* impl = static_cast<at::SparseTensorImpl*>(t.unsafeGetTensorImpl());
      cpu = twin_shell(t.dtype());
      auto* cimpl = static_cast<at::SparseTensorImpl*>(cpu.unsafeGetTensorImpl());
      if (cimpl->sparse_dim() != impl->sparse_dim() || cimpl->dense_dim() != impl->dense_dim() ||
          cimpl->sizes() != t.sizes())  // a shell keeps the shape of its last twin
        cimpl->raw_resize_(impl->sparse_dim(), impl->dense_dim(), t.sizes());
      set_members(cimpl, kernel_.alias(impl->indices()), kernel_.alias(impl->values()),
                  impl->coalesced());
      // [docs:end COO_TWIN]
    } else if (is_compressed(t)) {
      // CSR, CSC, BSR, BSC: compressed indices, plain indices and values.
      auto* impl = static_cast<at::SparseCsrTensorImpl*>(t.unsafeGetTensorImpl());
      cpu = at::detail::make_tensor<at::SparseCsrTensorImpl>(
          c10::DispatchKeySet(c10::DispatchKey::SparseCsrCPU), c10::Device(c10::kCPU),
          t.layout(), t.dtype());
      static_cast<at::SparseCsrTensorImpl*>(cpu.unsafeGetTensorImpl())
          ->set_member_tensors(kernel_.alias(impl->compressed_indices()),
                               kernel_.alias(impl->plain_indices()),
                               kernel_.alias(impl->values()), t.sizes());
    } else {
      // Strided nested: the buffer (device memory) plus CPU metadata shared as is.
      auto* impl = at::native::get_nested_tensor_impl(t);
      at::Tensor buffer = kernel_.alias(flat_over(t.storage(), c10::DispatchKey::PrivateUse1,
                                                  t.dtype()));
      cpu = at::detail::make_tensor<at::native::NestedTensorImpl>(buffer, impl->get_nested_sizes(),
                                                          impl->get_nested_strides(),
                                                          impl->get_storage_offsets());
    }
    twins_.push_back({cpu, borrow_ ? c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t) : t});
    return cpu;
  }

  // After the kernel: an openreg sparse argument written in place gets the members the CPU
  // kernel gave its twin (sparse kernels replace indices and values rather than write them).
  void sync_written(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != kOpenReg) return;
    if (!is_layout_tensor(t)) return kernel_.sync_written(t);
    for (auto& p : twins_)
      if (p.device.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) adopt_members(p.cpu, t);
  }

  at::Tensor from_cpu(at::Tensor cpu) {
    if (!cpu.defined() || !cpu.is_cpu()) return cpu;
    for (auto& p : twins_)
      if (p.cpu.unsafeGetTensorImpl() == cpu.unsafeGetTensorImpl()) {
        adopt_members(p.cpu, p.device);
        return p.device;  // an in-place kernel returns its argument
      }
    if (cpu.is_nested()) {
      auto* impl = at::native::get_nested_tensor_impl(cpu);
      at::Tensor sizes = host_metadata(impl->get_nested_sizes());
      at::Tensor strides = host_metadata(impl->get_nested_strides());
      at::Tensor offsets = host_metadata(impl->get_storage_offsets());
      c10::Storage storage = cpu.storage();
      auto dtype = cpu.dtype();
      cpu.reset();  // the buffer's only owner now: its device memory is adopted, not shared
      at::Tensor buffer = kernel_.result(flat_over(std::move(storage), c10::DispatchKey::CPU,
                                                   dtype));
      return at::detail::make_tensor<at::native::NestedTensorImpl>(buffer, sizes, strides, offsets);
    }
    if (!is_layout_tensor(cpu)) {
      TORCH_CHECK_NOT_IMPLEMENTED(cpu.layout() == c10::kStrided,
                                  "openreg does not support the layout ", cpu.layout());
      // Moved: a fresh dense result becomes the device tensor in place (RESULT_IN_PLACE).
      const c10::TensorImpl* made = cpu.unsafeGetTensorImpl();
      at::Tensor device = kernel_.result(std::move(cpu));
      if (device.unsafeGetTensorImpl() == made)
        g_dense_results_in_place.fetch_add(1, std::memory_order_relaxed);
      return device;
    }
    c10::DeviceGuard guard(c10::Device(kOpenReg, static_cast<c10::DeviceIndex>(device_)));
    if (cpu.is_sparse() && sparse_result_in_place(cpu)) return cpu;
    at::Tensor device;
    if (cpu.is_sparse()) {
      device = at::detail::make_tensor<at::SparseTensorImpl>(
          c10::DispatchKeySet(c10::DispatchKey::SparsePrivateUse1), cpu.dtype());
    } else {
      device = at::detail::make_tensor<at::SparseCsrTensorImpl>(
          c10::DispatchKeySet(c10::DispatchKey::SparseCsrPrivateUse1),
          c10::Device(kOpenReg, static_cast<c10::DeviceIndex>(device_)), cpu.layout(),
          cpu.dtype());
    }
    adopt_members(cpu, device);
    return device;
  }

 private:
  // [docs:start ADOPT_MEMBERS]
  // `device` (sparse, openreg) takes the shape and members of `cpu` (its twin or a result).
  void adopt_members(const at::Tensor& cpu, const at::Tensor& device) {
    if (cpu.is_sparse()) {
      auto* c = static_cast<at::SparseTensorImpl*>(cpu.unsafeGetTensorImpl());
      auto* d = static_cast<at::SparseTensorImpl*>(device.unsafeGetTensorImpl());
      at::Tensor indices = kernel_.result(c->indices());
      at::Tensor values = kernel_.result(c->values());
      if (d->indices().unsafeGetTensorImpl() == indices.unsafeGetTensorImpl() &&
          d->values().unsafeGetTensorImpl() == values.unsafeGetTensorImpl() &&
          d->sizes() == c->sizes() && d->sparse_dim() == c->sparse_dim() &&
          d->coalesced() == c->coalesced())
        return;  // unchanged
      d->raw_resize_(c->sparse_dim(), c->dense_dim(), cpu.sizes());
      set_members(d, std::move(indices), std::move(values), c->coalesced());
    } else if (is_compressed(cpu)) {
      auto* c = static_cast<at::SparseCsrTensorImpl*>(cpu.unsafeGetTensorImpl());
      auto* d = static_cast<at::SparseCsrTensorImpl*>(device.unsafeGetTensorImpl());
      d->set_member_tensors(kernel_.result(c->compressed_indices()),
                            kernel_.result(c->plain_indices()), kernel_.result(c->values()),
                            cpu.sizes());
    }
    // Nested kernels write the buffer in place; their metadata does not change.
  }
  // [docs:end ADOPT_MEMBERS]

  // [docs:start SPARSE_RESULT_IN_PLACE]
  // A fresh COO result nobody else holds becomes the device tensor itself, as a dense result does
  // (HostKernel::result): its SparseTensorImpl changes device, and so do its indices and values
  // where they are fresh device memory too (otherwise they become the device tensors they alias).
  // A new device SparseTensorImpl would allocate two empty members through the dispatcher only to
  // replace them (about 8,000 instructions per result, callgrind, issue 41).
  bool sparse_result_in_place(at::Tensor& cpu) {
    if (!unshared_plain_cpu_sparse(cpu)) return false;
    auto* c = static_cast<at::SparseTensorImpl*>(cpu.unsafeGetTensorImpl());
    at::Tensor indices = c->indices();
    at::Tensor values = c->values();
    const bool coalesced = c->coalesced();
    // The container lets go of its members (nothing else of it is released: it has no storage,
    // autograd metadata or Python object), so that the members' only owners are these handles.
    c->release_resources();
    indices = kernel_.result(std::move(indices));
    values = kernel_.result(std::move(values));
    const c10::Device dev(kOpenReg, static_cast<c10::DeviceIndex>(device_));
    c->_change_backend_component_keys(dev);
    c->*SparseDevice::device_opt() = dev;
    set_members(c, std::move(indices), std::move(values), coalesced);
    g_sparse_results_in_place.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  // [docs:end SPARSE_RESULT_IN_PLACE]

  struct Twin {
    at::Tensor cpu;
    at::Tensor device;  // borrowed if borrow_
  };
  HostKernel kernel_;
  const int device_;
  const bool borrow_;
  c10::SmallVector<Twin, 2> twins_;
};

// Operators that read CPU tensors beside openreg ones, as on CUDA: nested metadata (sizes,
// strides, offsets) always lives on the CPU, and the copies copy between devices.
bool takes_cpu_tensors(std::string_view name) {
  return name.rfind("aten::_nested", 0) == 0 || name == "aten::copy_";
}

// Operators returning a nested tensor's metadata, which lives on the CPU (as on CUDA).
bool returns_cpu_metadata(std::string_view name) {
  return name == "aten::_nested_tensor_size" || name == "aten::_nested_tensor_strides" ||
         name == "aten::_nested_tensor_storage_offsets";
}

// Calls of the fallback, for tests that prove an operator does not take it (`_route_calls`).
std::atomic<int64_t>& g_layout_calls = call_counter("layouts.fallback");

// [docs:start KERNEL_ERROR]
// In a catch block around a CPU kernel: its error as the CPU raised it (the context is added only
// with OPENREG_ERROR_CONTEXT=1), or, where the CPU has no kernel for the layout, a refusal naming
// the operator and the layout.
[[noreturn]] void rethrow_kernel_error(const c10::OperatorHandle& op, int device,
                                       const char* layout) {
  try {
    throw;
  } catch (c10::NotImplementedError& e) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "The operator '", op.schema().operator_name(),
                                "' is not implemented for openreg tensors with layout ", layout,
                                ": it has no CPU kernel for that layout to run on device "
                                "memory (", e.msg(), ")");
    throw;  // not reached
  } catch (c10::Error& e) {
    add_error_context(e, op, device, layout);
    throw;
  }
}
// [docs:end KERNEL_ERROR]

void layout_fallback(const c10::OperatorHandle& op, c10::Stack* stack) {
  g_layout_calls.fetch_add(1, std::memory_order_relaxed);
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  const ArgSummary& s = arg_summary(op);

  // The device, checked as the dense fallback checks it: one openreg device, no CPU tensors
  // except 0-dim ones (scalars) and where CUDA takes them too.
  int device = -1;
  const at::Tensor* layout_arg = nullptr;
  const bool cpu_ok = takes_cpu_tensors(schema.name());
  for (size_t i = 0; i < num_args; ++i) {
    const bool written_arg = s.writes[i];
    for_each_tensor((*stack)[first + i], s.kinds[i], [&](const at::Tensor& t) {
      if (!t.defined()) return;
      if (layout_arg == nullptr && is_layout_tensor(t)) layout_arg = &t;
      if (t.device().type() == kOpenReg) {
        int index = t.device().index();
        TORCH_CHECK(device < 0 || index == device,
                    "Expected all tensors to be on the same device, but found at least two "
                    "devices, openreg:", device, " and openreg:", index, "! (in ", schema.name(),
                    ")");
        device = index;
      } else {
        TORCH_CHECK(t.is_cpu() && ((cpu_ok && !written_arg) || (t.dim() == 0 && !is_layout_tensor(t))),
                    "Expected all tensors to be on the same device, but found at least two "
                    "devices, openreg and ", t.device(), "! (in ", schema.name(), ")");
      }
    });
    const c10::IValue& v = (*stack)[first + i];
    if (s.kinds[i] == ArgKind::Device && v.isDevice() && v.toDevice().type() == kOpenReg &&
        device < 0)
      device = v.toDevice().has_index() ? v.toDevice().index() : current_device();
  }
  if (device < 0) device = current_device();
  check_device(device);
  const char* layout = layout_arg ? layout_name(*layout_arg) : "strided";

  LayoutSession session(device);
  c10::SmallVector<c10::IValue, 2> written;
  for (size_t i = 0; i < num_args; ++i)
    if (s.writes[i]) written.push_back((*stack)[first + i]);
  materialize_written(s, *stack, first);  // copy-on-write (ops/cow.h)
  arguments_to_cpu(*stack, first, s, device,
                   [&](const at::Tensor& t) { return session.to_cpu(t); });

  // [docs:start LAYOUT_CALL]
  // The arguments are CPU tensors now: a full dispatch picks the CPU kernel of their layout
  // (SparseCPU, SparseCsrCPU, NestedTensorCPU, CPU, or a composite one).
  try {
    op.callBoxed(stack);
  } catch (c10::Error&) {
    rethrow_kernel_error(op, device, layout);
  }
  // [docs:end LAYOUT_CALL]

  for (const c10::IValue& v : written) {
    if (v.isTensor()) session.sync_written(v.toTensor());
    else if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList()) session.sync_written(t);
  }
  const size_t num_returns = schema.returns().size();
  if (returns_cpu_metadata(schema.name())) {
    for (size_t i = stack->size() - num_returns; i < stack->size(); ++i)
      if ((*stack)[i].isTensor()) (*stack)[i] = host_metadata((*stack)[i].toTensor());
    return;
  }
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      at::Tensor t = v.toTensor();
      v = c10::IValue();  // the session adopts a result's memory only when it is its sole owner
      v = session.from_cpu(std::move(t));
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : list) out.push_back(session.from_cpu(t));
      v = std::move(out);
    }
  }
}

// [docs:start LAYOUT_ROUTE]
// Route: unboxed kernels for the COO operators of the loops of test suites and optimizers whose
// cost is mostly the fallback's own (`dense + sparse`, `dense.add_(sparse)`, `to_dense`, each
// about 6,000 instructions more than on the CPU through the fallback, callgrind, issue 41), and
// those of sparse optimizer steps (`index_select`, `_coalesce`, `sparse_mask`): boxing copies
// each tensor argument, and a copy of a tensor Python holds takes a reference on its Python
// object under the GIL, which the call had released, and its release drops it the same way (two
// GIL round trips per tensor and call). A
// kernel does what the fallback does, in the same LayoutSession, without boxing the arguments
// and with the session borrowing them (the caller holds them for the call): CPU twins and
// aliases, the same full dispatch to the CPU's kernel, the same errors, the write-back, results
// made device tensors. Anything out of the ordinary (a tensor on another device or of another
// layout, an undefined one, a sparse tensor written in place, a copy-on-write one written) is
// boxed and handed to the fallback, which checks, refuses or runs it exactly as before. A loop on
// the same tensors finds their aliases in the route's memo (HostKernel's ALIAS_MEMO).
#define OPENREG_LAYOUT_ROUTES(X) \
  X(add_Tensor) X(add__Tensor) X(_to_dense) X(index_select) X(_coalesce) X(sparse_mask)
std::atomic<int64_t>& g_layout_direct = call_counter("layouts.direct");
// [docs:end LAYOUT_ROUTE]

template <class Op, class Sig = typename Op::schema>
struct LayoutRoute;

template <class Op, class Ret, class... Args>
struct LayoutRoute<Op, Ret(Args...)> {
  template <class T>
  using Bare = std::remove_cv_t<std::remove_reference_t<T>>;
  // What the CPU kernel gets: a twin or alias for each tensor, anything else as it is.
  template <class T>
  using Cpu = std::conditional_t<std::is_same_v<Bare<T>, at::Tensor>, at::Tensor, T>;
  static_assert(((std::is_same_v<Bare<Args>, at::Tensor> || !std::is_class_v<Bare<Args>> ||
                  std::is_same_v<Bare<Args>, c10::Scalar> ||
                  std::is_same_v<Bare<Args>, std::optional<at::ScalarType>> ||
                  std::is_same_v<Bare<Args>, std::optional<bool>>) && ...),
                "an argument the layout route cannot take");

  static const c10::OperatorHandle& op() { return op_handle<Op>(); }
  static const std::array<bool, sizeof...(Args)>& writes() {
    return written_args<Op, sizeof...(Args)>();
  }

  // The call's device, or -1 where the fallback must take it.
  struct Check {
    int device = -1;
    bool plain = true;
    const at::Tensor* layout_arg = nullptr;
    template <class T>
    void arg(const T& a, bool written) {
      if constexpr (std::is_same_v<Bare<T>, at::Tensor>) {
        if (!a.defined() || a.device().type() != kOpenReg) {
          plain = false;
          return;
        }
        const int index = a.device().index();
        if (device < 0) device = index;
        else if (index != device) plain = false;
        if (a.is_sparse()) {
          if (written) plain = false;  // the twin's members become the device tensor's
          if (layout_arg == nullptr) layout_arg = &a;
        } else if (is_layout_tensor(a) || (written && is_cow(a))) {
          plain = false;
        }
      }
    }
  };

  static int memo_site() {
    static const int site = HostKernel::new_memo_site();
    return site;
  }

  static Ret boxed(c10::DispatchKeySet ks, Args... args) {
    return c10::impl::BoxedKernelWrapper<Ret(Args...)>::call(
        c10::BoxedKernel::makeFromFunction<&layout_fallback>(), op(), ks,
        std::forward<Args>(args)...);
  }

  // [docs:start LAYOUT_ROUTE_CALL]
  static Ret call(c10::DispatchKeySet ks, Args... args) {
    const auto& w = writes();
    Check c;
    {
      size_t i = 0;
      (c.arg(args, w[i++]), ...);
    }
    if (!c.plain || c.device < 0 || c.layout_arg == nullptr)
      return boxed(ks, std::forward<Args>(args)...);
    g_layout_direct.fetch_add(1, std::memory_order_relaxed);
    check_device(c.device);
    return run(c.device, layout_name(*c.layout_arg), std::index_sequence_for<Args...>{}, args...);
  }

  template <class T>
  static Cpu<T> to_cpu(LayoutSession& session, T& a) {
    if constexpr (std::is_same_v<Bare<T>, at::Tensor>) return session.to_cpu(a);
    else return a;
  }

  template <size_t... I>
  static Ret run(int device, const char* layout, std::index_sequence<I...>, Args&... args) {
    LayoutSession session(device, /*caller_holds_arguments=*/true, memo_site());
    // Destroyed before the session: the twins' shells go back only if nothing else holds them.
    std::tuple<Cpu<Args>...> cpu{to_cpu<Args>(session, args)...};
    Bare<Ret> r;
    try {
      r = Op::call(std::get<I>(cpu)...);
    } catch (c10::Error&) {
      rethrow_kernel_error(op(), device, layout);
    }
    ((writes()[I] ? sync_arg(session, args) : void()), ...);
    if constexpr (std::is_same_v<Ret, at::Tensor&>) {
      // In place: the written argument, as the boxed call returns it.
      return std::get<0>(std::forward_as_tuple(args...));
    } else {
      static_assert(std::is_same_v<Ret, at::Tensor>, "a return the layout route cannot give");
      return session.from_cpu(std::move(r));
    }
  }
  // [docs:end LAYOUT_ROUTE_CALL]

  template <class T>
  static void sync_arg(LayoutSession& session, T& a) {
    if constexpr (std::is_same_v<Bare<T>, at::Tensor>) session.sync_written(a);
  }
};

const std::vector<std::string_view>& layout_route_names() {
  static const std::vector<std::string_view> names = {
#define OPENREG_NAME(op) registration_name<at::_ops::op>(),
      OPENREG_LAYOUT_ROUTES(OPENREG_NAME)
#undef OPENREG_NAME
  };
  return names;
}

void register_layout_routes(torch::Library& m) {
#define OPENREG_REGISTER(op) \
  m.impl(registration_name<at::_ops::op>(), TORCH_FN((&LayoutRoute<at::_ops::op>::call)));
  OPENREG_LAYOUT_ROUTES(OPENREG_REGISTER)
#undef OPENREG_REGISTER
}

}  // namespace

// [docs:start NESTED_TO_COPY]
// Copies of a nested tensor to another device or dtype (`.cpu()`, `.to("openreg:1")`): the CPU
// kernel would allocate the copy inside the kernel session, in device memory, even for a CPU
// target. The buffer goes through the dense copy instead (stream-ordered D2H/H2D/D2D), and the
// metadata stays on the CPU, shared.
at::Tensor nested_to_copy(const at::Tensor& self, std::optional<at::ScalarType> dtype,
                          std::optional<at::Layout> layout, std::optional<at::Device> device,
                          std::optional<bool> pin_memory, bool non_blocking,
                          std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK_NOT_IMPLEMENTED(!layout.has_value() || *layout == c10::kStrided,
                              "openreg: converting a nested tensor to layout ", *layout,
                              " is not supported");
  auto* impl = at::native::get_nested_tensor_impl(self);
  at::Tensor buffer = flat_over(self.storage(), c10::DispatchKey::PrivateUse1, self.dtype());
  c10::OptionalDeviceGuard guard(self.device());
  at::Tensor copy = buffer.to(buffer.options()
                                  .dtype(dtype.value_or(self.scalar_type()))
                                  .device(device.value_or(self.device()))
                                  .pinned_memory(pin_memory),
                              non_blocking, /*copy=*/true);
  return at::detail::make_tensor<at::native::NestedTensorImpl>(
      copy, impl->get_nested_sizes(), impl->get_nested_strides(), impl->get_storage_offsets());
}
// [docs:end NESTED_TO_COPY]

// [docs:start SPARSE_COPY]
// copy_ between sparse COO tensors on any two devices (the CPU's kernel would only see CPU twins
// of the openreg side): the destination takes copies of the source's indices and values, made by
// the dense copies (D2D, H2D, D2H, in stream order).
at::Tensor& sparse_copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  TORCH_CHECK(self.is_sparse() && src.is_sparse(),
              "copy_() between dense and sparse Tensors is not implemented! Found self type = ",
              self.toString(), " and src type = ", src.toString());
  if (self.is_same(src)) return self;
  auto* d = static_cast<at::SparseTensorImpl*>(self.unsafeGetTensorImpl());
  auto* s = static_cast<at::SparseTensorImpl*>(src.unsafeGetTensorImpl());
  at::Tensor indices = s->indices().to(d->indices().options(), non_blocking, /*copy=*/true);
  at::Tensor values = s->values().to(d->values().options(), non_blocking, /*copy=*/true);
  d->raw_resize_(s->sparse_dim(), s->dense_dim(), src.sizes());
  d->set_indices_and_values_unsafe(indices, values);
  d->set_coalesced(s->coalesced());
  return self;
}
// [docs:end SPARSE_COPY]

// [docs:start SPARSE_DIRECT]
// COO operators whose kernel is one function for the CPU, CUDA and Meta, because it only reads or
// sets the SparseTensorImpl's members and metadata (`_indices`, `is_coalesced`, the constructor
// from indices and values): openreg registers the same functions, as CUDA does, instead of
// building a CPU twin of each argument and a device tensor of each result for them. They are
// what every sparse operator's composite code calls (`coalesce` asks `is_coalesced`, optimizers
// take `_indices` and `_values` and build new sparse tensors from them): through the fallback
// they cost about 10,000 instructions each, more than many CPU kernels (callgrind, issue 41).
at::Tensor sparse_with_dims_and_tensors(int64_t sparse_dim, int64_t dense_dim,
                                        c10::SymIntArrayRef size, const at::Tensor& indices,
                                        const at::Tensor& values,
                                        std::optional<at::ScalarType> dtype,
                                        std::optional<at::Layout> layout,
                                        std::optional<at::Device> device,
                                        std::optional<bool> pin_memory,
                                        std::optional<bool> is_coalesced) {
  // The device's checks and messages (all tensors on one openreg device) are the fallback's.
  for (const at::Tensor* t : {&indices, &values})
    TORCH_CHECK(t->device().type() == kOpenReg,
                "Expected all tensors to be on the same device, but found at least two devices, "
                "openreg and ", t->device(), "! (in aten::_sparse_coo_tensor_with_dims_and_tensors)");
  TORCH_CHECK(indices.device() == values.device(),
              "Expected all tensors to be on the same device, but found at least two devices, ",
              indices.device(), " and ", values.device(),
              "! (in aten::_sparse_coo_tensor_with_dims_and_tensors)");
  c10::DeviceGuard guard(values.device());
  return at::native::new_with_dims_and_tensor_sparse_symint(
      sparse_dim, dense_dim, size, indices, values, dtype, layout, values.device(), pin_memory,
      is_coalesced);
}

const char* const kSparseDirect[] = {"_indices", "_values", "indices", "values", "is_coalesced",
                                     "_coalesced_", "_nnz", "sparse_dim", "dense_dim",
                                     "_sparse_coo_tensor_with_dims_and_tensors"};

void register_sparse_direct(torch::Library& m) {
  m.impl("_indices", at::native::_indices_sparse);
  m.impl("_values", at::native::_values_sparse);
  m.impl("indices", at::native::indices_sparse);
  m.impl("values", at::native::values_sparse);
  m.impl("is_coalesced", at::native::is_coalesced_sparse);
  m.impl("_coalesced_", at::native::_coalesced_sparse_);
  m.impl("_nnz", at::native::_nnz_sparse);
  m.impl("sparse_dim", at::native::sparse_dim_sparse);
  m.impl("dense_dim", at::native::dense_dim_sparse);
  m.impl("_sparse_coo_tensor_with_dims_and_tensors", sparse_with_dims_and_tensors);
}
// [docs:end SPARSE_DIRECT]

// [docs:start LAYOUT_REGISTRATION]
TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&layout_fallback>());
}
TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&layout_fallback>());
}
TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&layout_fallback>());
}
// Every operator with a CPU kernel for a layout runs it through this fallback on openreg, even
// where a composite kernel would otherwise take the openreg layout key before the fallback
// (clone, copy_, ... have CompositeExplicitAutograd kernels written for dense tensors; CPU and
// CUDA have kernels of their own for each layout). Registered when the library loads: torch's
// own registrations are complete by then.
void route_layout_ops(torch::Library& m, c10::DispatchKey cpu_key) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(cpu_key)) continue;
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    if (full == "_to_copy" && cpu_key == c10::DispatchKey::NestedTensorCPU) continue;
    if ((full == "copy_" || full == "copy_sparse_to_sparse_") &&
        cpu_key == c10::DispatchKey::SparseCPU)
      continue;  // sparse_copy_
    if (cpu_key == c10::DispatchKey::SparseCPU &&
        std::find_if(std::begin(kSparseDirect), std::end(kSparseDirect),
                     [&](const char* d) { return full == d; }) != std::end(kSparseDirect))
      continue;  // register_sparse_direct
    if (cpu_key == c10::DispatchKey::SparseCPU &&
        std::find(layout_route_names().begin(), layout_route_names().end(), full) !=
            layout_route_names().end())
      continue;  // register_layout_routes
    m.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&layout_fallback>());
  }
}
TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  route_layout_ops(m, c10::DispatchKey::SparseCPU);
  register_sparse_direct(m);
  register_layout_routes(m);
  m.impl("copy_", sparse_copy_);
  m.impl("copy_sparse_to_sparse_", sparse_copy_);
}
TORCH_LIBRARY_IMPL(aten, SparseCsrPrivateUse1, m) {
  route_layout_ops(m, c10::DispatchKey::SparseCsrCPU);
}
TORCH_LIBRARY_IMPL(aten, NestedTensorPrivateUse1, m) {
  route_layout_ops(m, c10::DispatchKey::NestedTensorCPU);
  m.impl("_to_copy", nested_to_copy);
}
// Dense openreg tensors in, a sparse or nested tensor out: the dispatch key is PrivateUse1, but
// the result needs this fallback's conversion (the dense fallback hands back strided tensors).
// _embedding_bag_backward returns the sparse gradient of EmbeddingBag(sparse=True).
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name :
       {"_to_sparse", "_to_sparse.sparse_dim", "_to_sparse_csr", "_to_sparse_csc",
        "_to_sparse_bsr", "_to_sparse_bsc", "_nested_tensor_from_mask", "_nested_from_padded",
        "_nested_view_from_buffer", "_embedding_bag_backward"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&layout_fallback>());
}
// [docs:end LAYOUT_REGISTRATION]

}  // namespace openreg
