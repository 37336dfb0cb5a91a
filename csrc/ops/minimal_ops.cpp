// Native because: the minimal operator set manages device memory and tensor metadata directly
// (factories, views, set_, resize_, copies, scalars): PyTorch calls these on every tensor
// creation and transfer, and the generic fallback relies on them.
#include "ops/minimal_ops.h"

#include "adapters/device_allocator.h"
#include "adapters/graph.h"
#include "adapters/host_allocator.h"
#include "ops/async_kernel.h"
#include "ops/cow.h"
#include "ops/cpu_kernel.h"
#include "routes/op_fallback.h"
#include "runtime/device.h"
#include "runtime/device_profile.h"
#include "runtime/faults.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ExpandUtils.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Context.h>
#include <ATen/native/Resize.h>
#include <ATen/native/ResizeCommon.h>
#include <ATen/native/TensorFactories.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstring>
#include <optional>

namespace openreg {
namespace {

constexpr auto kOpenReg = c10::DeviceType::PrivateUse1;

int device_index(std::optional<c10::Device> device) {
  if (!device.has_value() || !device->has_index()) return current_device();
  TORCH_CHECK(device->type() == kOpenReg, "openreg: expected an openreg device, got ", *device);
  check_device(device->index());
  return device->index();
}

int tensor_device(const at::Tensor& t) { return t.device().index(); }

void check_layout(std::optional<c10::Layout> layout) {
  TORCH_CHECK_NOT_IMPLEMENTED(!layout.has_value() || *layout == c10::kStrided,
                              "openreg supports only strided tensors, got layout ", *layout);
}

// torch.use_deterministic_algorithms(True) with torch.utils.deterministic.fill_uninitialized_memory.
bool fill_uninitialized() {
  return at::globalContext().deterministicAlgorithms() &&
         at::globalContext().deterministicFillUninitializedMemory();
}

void check_pin(std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");
}

// [docs:start EMPTY.MEMORY_FORMAT]
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device, std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  check_layout(layout);
  check_pin(pin_memory);
  int index = device_index(device);
  check_profile_dtype(c10::dtype_or_default(dtype), index);  // docs/device_profiles.md
  at::Tensor t = at::detail::empty_generic(size, allocator_for_device(index),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype), memory_format);
  // With torch.use_deterministic_algorithms(True), filled (NaN, or the largest integer) as on
  // the CPU and CUDA.
  if (C10_UNLIKELY(fill_uninitialized())) at::native::fill_empty_deterministic_(t);
  return t;
}
// [docs:end EMPTY.MEMORY_FORMAT]

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_layout(layout);
  check_pin(pin_memory);
  int index = device_index(device);
  check_profile_dtype(c10::dtype_or_default(dtype), index);
  at::Tensor t = at::detail::empty_strided_generic(
      size, stride, allocator_for_device(index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
  if (C10_UNLIKELY(fill_uninitialized())) at::native::fill_empty_deterministic_(t);
  return t;
}

// [docs:start RESIZE]
// Sets sizes (and strides) and grows the storage if they need more bytes: the CPU's resize, with
// its checks and messages (negative sizes, overflow), on device memory.
void resize_impl(c10::TensorImpl* self, c10::IntArrayRef size, at::OptionalIntArrayRef stride) {
  if (self->sizes() == size && (!stride || self->strides() == *stride)) return;
  const auto itemsize = self->dtype().itemsize();
  const auto offset = self->storage_offset();
  size_t needed = 0;
  if (stride) {
    self->set_sizes_and_strides(size, *stride);
    needed = at::detail::computeStorageNbytes(size, *stride, itemsize, offset);
  } else {
    self->set_sizes_contiguous(size);
    needed = at::detail::computeStorageNbytesContiguous(size, itemsize, offset);
  }
  if (self->numel() == 0) return;
  auto* storage = self->storage().unsafeGetStorageImpl();
  if (needed > storage->nbytes()) resize_storage_bytes(storage, needed);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  const int64_t old_nbytes = static_cast<int64_t>(impl->storage().nbytes());
  resize_impl(impl, size, std::nullopt);
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve, "Unsupported memory format",
                *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  // With torch.use_deterministic_algorithms(True), new memory is filled (NaN, or the largest
  // integer) as on the CPU and CUDA.
  if (C10_UNLIKELY(fill_uninitialized())) at::native::fill_resize_deterministic_(self, old_nbytes);
  return self;
}
// [docs:end RESIZE]

// set_ as the CPU's: checkSetStorage (size/stride lengths, offset, same device), then a resize.
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t storage_offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  at::native::checkSetStorage(self, std::move(source), storage_offset, size, stride);
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_offset(storage_offset);
  resize_impl(impl, size,
              stride.data() != nullptr ? at::OptionalIntArrayRef(stride) : std::nullopt);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(),
                     source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, allocator_for_device(tensor_device(self)),
                     /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

// A byte copy when layouts agree, else the CPU copy kernel (dtype conversion, broadcasting,
// arbitrary strides, conjugate and negative bits).
// Overlapping source and destination (views of one storage) go to the CPU kernel too, so they
// are accepted or rejected exactly as on the CPU.
void copy_between(const at::Tensor& dst, const at::Tensor& src) {
  if (!dst.is_alias_of(src) && dst.dtype() == src.dtype() && dst.sizes() == src.sizes() && dst.strides() == src.strides() &&
      dst.is_non_overlapping_and_dense() && !dst.is_conj() && !src.is_conj() && !dst.is_neg() &&
      !src.is_neg()) {
    size_t nbytes = dst.numel() * dst.element_size();
    if (nbytes > 0)
      std::memmove(static_cast<char*>(dst.data_ptr()) , src.const_data_ptr(), nbytes);
    return;
  }
  dst.copy_(src);
}

bool pinned(const at::Tensor& host) { return is_pinned_pointer(host.const_data_ptr()); }

// A CPU tensor with the same metadata as `host` over its memory, without owning it.
at::Tensor non_owning(const at::Tensor& host) {
  const c10::Storage& storage = host.storage();
  c10::Storage view(c10::Storage::use_byte_size_t(), storage.nbytes(),
                    c10::DataPtr(const_cast<void*>(storage.data()), host.device()),
                    /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor t = at::empty({0}, host.options().pinned_memory(false));
  t.set_(view, host.storage_offset(), host.sizes(), host.strides());
  t._set_conj(host.is_conj());
  t._set_neg(host.is_neg());
  return t;
}

// [docs:start COPY_CHECKS]
// copy_ hands a copy involving openreg to _copy_from before checking anything (at::copy_ checks
// in the device's copy kernel). So the checks the CPU's copy kernel makes come here, in its
// order and with its messages, before anything is queued: the destination must not overlap
// itself or the source, and the source must broadcast to the destination's shape exactly
// (an empty destination included). Returns false when there is nothing to copy (same memory).
bool check_copy(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.is_alias_of(src) && dst.storage_offset() == src.storage_offset() &&
      dst.strides().equals(src.strides()) && dst.sizes().equals(src.sizes()) &&
      dst.scalar_type() == src.scalar_type() && dst.is_conj() == src.is_conj() &&
      dst.is_neg() == src.is_neg())
    return false;
  at::assert_no_internal_overlap(dst);
  at::assert_no_partial_overlap(dst, src);
  if (!dst.sizes().equals(src.sizes())) {
    c10::DimVector shape(dst.sizes().begin(), dst.sizes().end());
    if (shape.empty()) shape.assign(src.sizes().begin(), src.sizes().end());
    else if (!src.sizes().empty()) shape = at::infer_size_dimvector(shape, src.sizes());
    TORCH_CHECK(dst.sizes().equals(shape), "output with shape ", dst.sizes(),
                " doesn't match the broadcast shape ", c10::IntArrayRef(shape));
  }
  return dst.numel() > 0;
}
// [docs:end COPY_CHECKS]

// [docs:start CAPTURE_COPY]
// A copy issued on a capturing stream is recorded: device to device, and asynchronous copies
// with pinned host memory (the host memory is read or written at each replay, as on CUDA).
// A copy with pageable host memory makes the host wait: not permitted during capture.
void capture_copy(Capture* capture, const at::Tensor& self, const at::Tensor& dst,
                  bool non_blocking, bool src_dev, bool dst_dev) {
  if (!(src_dev && dst_dev)) {
    const at::Tensor& host = src_dev ? dst : self;
    if (!(non_blocking && pinned(host)))
      capture_fail(capture, c10::str("openreg: a copy ", src_dev ? "to" : "from", " pageable "
                                     "host memory (or with non_blocking=False) makes the host "
                                     "wait for the device: not permitted while the stream is "
                                     "capturing a graph (operation not permitted when stream is "
                                     "capturing; use pinned memory and non_blocking=True)"));
  }
  at::Tensor d = dst_dev ? graph_alias(dst) : dst;
  at::Tensor s = src_dev ? graph_alias(self) : self;
  const int src_device = src_dev ? tensor_device(self) : -1;
  const int dst_device = dst_dev ? tensor_device(dst) : -1;
  capture_record(capture, c10::str("copy ", self.device(), " -> ", dst.device(), " ",
                                   dst.scalar_type(), dst.sizes()),
                 [d, s, src_device, dst_device] {
                   if (src_device >= 0 && dst_device >= 0 && src_device != dst_device)
                     stream_wait(current_stream(src_device));
                   at::AutoDispatchBelowADInplaceOrView below_autograd;
                   KernelScope kernel;
                   copy_between(d, s);
                 });
}
// [docs:end CAPTURE_COPY]

// [docs:start COPY_FROM]
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool src_dev = self.device().type() == kOpenReg;
  const bool dst_dev = dst.device().type() == kOpenReg;
  TORCH_CHECK((src_dev || self.is_cpu()) && (dst_dev || dst.is_cpu()),
              "openreg: copy between ", self.device(), " and ", dst.device(), " is not supported");
  if (!check_copy(dst, self)) return dst;
  if (Capture* c = capturing(dst_dev ? tensor_device(dst) : tensor_device(self))) {
    capture_copy(c, self, dst, non_blocking, src_dev, dst_dev);
    return dst;
  }
  if (src_dev && dst_dev) {
    // Device to device (same or other device): ordered after the source device's current stream
    // (waited for, not held: holding both streams could deadlock against a copy the other way)
    // and run on the destination device's current stream.
    if (tensor_device(self) != tensor_device(dst)) stream_wait(current_stream(tensor_device(self)));
    // Asynchronous kernel mode (ops/async_kernel.h): queued on the stream like a kernel.
    else if (async_kernels_enabled() && async_device_copy(dst, self)) return dst;
    HostKernel k(tensor_device(dst));
    mark_launch_as(ActivityKind::CopyDtoD, size_t(dst.numel()) * dst.element_size());
    materialize_written(dst);  // copy-on-write (ops/cow.h)
    copy_between(k.alias(dst), k.alias(self));
    return dst;
  }
  const at::Tensor& device_side = src_dev ? self : dst;
  const at::Tensor& host_side = src_dev ? dst : self;
  int device = tensor_device(device_side);
  // A copy-on-write destination is materialized by the blocking copy, in stream order (ops/cow.h).
  if (non_blocking && pinned(host_side) && !is_cow(dst)) {
    // [docs:start ASYNC_COPY]
    // Asynchronous: queued on the current stream behind the work already issued there, and run
    // by the stream's worker through the device's simulated copy engine. The host gets control
    // back at once and must synchronize before it reads the destination (device to host) or
    // writes the source (host to device). The task holds both tensors' memory until it ran.
    // The host side is held like CUDA holds it: the queued copy works on a non-owning view, and
    // the pinned allocator is told (record_event) that the block is in use on this stream, so
    // if the caller frees the tensor now, its block is not handed out again before the copy ran.
    at::Tensor alias = cpu_alias(device_side);
    Stream* stream = current_stream(device);
    c10::Stream torch_stream(c10::Stream::UNSAFE, device_side.device(), stream_id(stream));
    at::Tensor host = record_host_use(host_side, torch_stream) ? non_owning(host_side) : host_side;
    size_t nbytes = size_t(dst.numel()) * dst.element_size();
    enqueue_copy(stream, /*host_to_device=*/!src_dev, nbytes,
                 [alias, host, src_dev] {
                   at::AutoDispatchBelowADInplaceOrView below_autograd;
                   KernelScope kernel;
                   if (src_dev) copy_between(host, alias);
                   else copy_between(alias, host);
                 });
    return dst;
    // [docs:end ASYNC_COPY]
  }
  HostKernel k(device);
  if (src_dev) check_device_fault(device);  // a blocking copy to the host synchronizes
  mark_launch_as(src_dev ? ActivityKind::CopyDtoH : ActivityKind::CopyHtoD,
                      size_t(dst.numel()) * dst.element_size());
  if (src_dev) {
    copy_between(dst, k.alias(self));  // a CPU kernel's write: materializes a COW destination
  } else {
    materialize_written(dst);  // copy-on-write (ops/cow.h)
    copy_between(k.alias(dst), self);
  }
  return dst;
}
// [docs:end COPY_FROM]

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

// [docs:start HOST_READ]
// The one element of a plain tensor of a common dtype, read from device memory (host memory in
// this simulation) while the HostKernel holds the stream: what the CPU's kernel reads through an
// alias. An LBFGS step reads about 900 device scalars on the host (its line search's tests and
// dot products, tensors passed as Python numbers); making the alias and dispatching to the CPU's
// kernel was 1,300 of the 2,100 instructions of each read. Anything else (math bits, other
// dtypes, several elements, zero tensors) goes through the alias and the CPU's kernel as before.
std::optional<c10::Scalar> read_one_element(const at::Tensor& self) {
  if (self.layout() != c10::kStrided || !self.has_storage() || self.numel() != 1 ||
      self.is_conj() || self.is_neg() || self._is_zerotensor())
    return std::nullopt;
  const void* p = self.const_data_ptr();
  if (p == nullptr) return std::nullopt;  // (an efficient zero tensor has no memory)
  switch (self.scalar_type()) {
    case at::kDouble: return c10::Scalar(*static_cast<const double*>(p));
    case at::kFloat: return c10::Scalar(*static_cast<const float*>(p));
    case at::kLong: return c10::Scalar(*static_cast<const int64_t*>(p));
    case at::kInt: return c10::Scalar(*static_cast<const int32_t*>(p));
    // As the CPU's kernel: the byte, not a bool* read, which may hold another value than 0 or 1.
    case at::kBool: return c10::Scalar(static_cast<bool>(*static_cast<const uint8_t*>(p)));
    default: return std::nullopt;
  }
}
// [docs:end HOST_READ]

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  warn_or_error_on_sync("aten::_local_scalar_dense");  // item(): the host waits for the device
  check_capture_permits("reading a value on the host (item(), _local_scalar_dense)",
                        tensor_device(self), current_stream(tensor_device(self)));
  HostKernel k(tensor_device(self));
  check_device_fault(tensor_device(self));  // a sticky kernel error (runtime/faults.h)
  if (std::optional<c10::Scalar> v = read_one_element(self)) return *v;
  return at::_local_scalar_dense(k.alias(self));
}

// [docs:start VIEWS]
// Views: a new device TensorImpl over the same storage, with the view's sizes, strides, offset.
at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}
// [docs:end VIEWS]

// [docs:start EFFICIENT_ZERO_TENSOR]
// A tensor known to be all zeros without memory (autograd uses them for gradients it knows are
// zero): the ZeroTensor key makes every operator see it as zeros. Built here because the CPU
// kernel would make a CPU tensor, and the fallback cannot carry the ZeroTensor key over.
c10::DataPtr no_memory(int device) {
  return c10::DataPtr(nullptr, c10::Device(kOpenReg, static_cast<c10::DeviceIndex>(device)));
}

at::Tensor efficient_zero_tensor(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                                 std::optional<c10::Layout> layout,
                                 std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_layout(layout);
  int index = device_index(device);
  // No memory, but the CPU's storage size (that of a contiguous tensor of this size): views of
  // it (as_strided, which batched gradients make) are checked against that size, as on the CPU.
  const auto scalar_type = c10::dtype_or_default(dtype);
  check_profile_dtype(scalar_type, index);
  const size_t nbytes =
      at::detail::computeStorageNbytesContiguous(size, c10::elementSize(scalar_type));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, no_memory(index), nullptr,
                       /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage),
      c10::DispatchKeySet({c10::DispatchKey::PrivateUse1, c10::DispatchKey::ZeroTensor}),
      c10::scalarTypeToTypeMeta(scalar_type));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(size);
  return t;
}
// [docs:end EFFICIENT_ZERO_TENSOR]

void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == kOpenReg, "record_stream: expected an openreg stream, got ",
              stream);
  device_allocator()->recordStream(self.storage().data_ptr(), stream);
}

}  // namespace

void resize_storage_bytes(c10::StorageImpl* storage, size_t new_bytes) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  int device = storage->device().index();
  c10::DataPtr fresh = allocate_on_device(device, new_bytes);
  size_t keep = std::min(storage->nbytes(), new_bytes);
  if (keep > 0) {
    LaunchScope launch(current_stream(device));
    KernelScope kernel;
    std::memcpy(fresh.get(), storage->data(), keep);
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(new_bytes);
}

// [docs:start TORCH_LIBRARY_IMPL]
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream);
  m.impl("_efficientzerotensor", efficient_zero_tensor);
}
// [docs:end TORCH_LIBRARY_IMPL]

// [docs:start COPY_MATH_BITS]
// A device without a copy kernel of its own (copy_stub) gets every copy_ through _copy_from. The
// conjugate and negative fallbacks would resolve a conjugated or negated source by cloning it,
// and a clone is a copy_: _copy_from again, forever (a stack overflow, seen on the fft ops).
// Let _copy_from through those keys instead: copy_from hands the bits to the CPU copy kernel,
// which applies them while it copies, as the CPU's own copy_ does.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
// [docs:end COPY_MATH_BITS]

}  // namespace openreg
