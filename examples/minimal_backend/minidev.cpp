// Native because: PyTorch accepts allocators, guards, hooks, generators and kernels only from C++.
//
// minidev, the smallest PrivateUse1 backend that passes every required check of
// `python -m torch_openreg.check --import minidev` (walked through in docs/first_backend.md).
// Its device memory is host memory from malloc, and every operator without a kernel here runs
// on the CPU through PyTorch's copying fallback (at::native::cpu_fallback). It leaves out, with
// the openreg page that shows the complete version: a caching allocator (docs/device_allocator.md),
// streams that queue work and events that wait for it (docs/streams.md, docs/events.md), lazy
// initialisation and fork detection (docs/device.md), pinned memory (docs/host_allocator.md), a
// zero-copy fallback (docs/fallback.md), views other than view/as_strided/_reshape_alias
// (docs/minimal_ops.md), backend metadata in checkpoints (docs/serialization.md), compile,
// distributed and the profiler (their pages in docs/). Autocast is optional/autocast.cpp.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace {

constexpr auto kType = c10::DeviceType::PrivateUse1;
const c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);
constexpr int kDevices = 2;
constexpr size_t kCapacity = size_t(4) << 30;  // 4 GiB per device

// [docs:start DEVICES]
thread_local int current_device = 0;  // per thread, as on CUDA

int check_device(int index) {
  TORCH_CHECK(index >= 0 && index < kDevices, "minidev device index is out of range: got ", index,
              ", but there are ", kDevices, " devices");
  return index;
}

int index_of(c10::Device d) { return d.has_index() ? check_device(d.index()) : current_device; }
c10::Device device_of(int index) { return {kType, static_cast<c10::DeviceIndex>(index)}; }
// [docs:end DEVICES]

// [docs:start ALLOCATOR]
using c10::CachingDeviceAllocator::DeviceStats;

struct Allocation {
  void* ptr;
  size_t size;
  int device;
};

struct MallocAllocator final : c10::DeviceAllocator {
  std::mutex mutex;
  DeviceStats stats[kDevices];  // what torch.accelerator.memory_stats() reports

  // Nothing is cached: reserved memory is allocated memory.
  void count(int device, size_t size, bool add) {
    auto& s = stats[device];
    for (auto* bytes : {&s.allocated_bytes[0], &s.reserved_bytes[0]})
      add ? bytes->increase(size) : bytes->decrease(size);
    add ? s.allocation[0].increase(1) : s.allocation[0].decrease(1);
  }

  c10::DataPtr allocate(size_t size) override {
    const int device = current_device;
    const c10::Device where = device_of(device);
    if (size == 0) return {nullptr, where};
    std::lock_guard<std::mutex> lock(mutex);
    const size_t used = stats[device].reserved_bytes[0].current;
    void* ptr = size <= kCapacity - used ? std::malloc(size) : nullptr;
    if (ptr == nullptr) {
      stats[device].num_ooms++;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "minidev out of memory: tried to allocate ", size,
                       " bytes on minidev:", device, ", which has ", kCapacity - used, " of its ",
                       kCapacity, " bytes free");
    }
    count(device, size, true);
    return {ptr, new Allocation{ptr, size, device}, &release, where};
  }
  static void release(void* context);

  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // nothing cached
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // streams complete at once
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex);
    return stats[check_device(device)];
  }
  void resetPeakStats(c10::DeviceIndex device) override { reset(device, true); }
  void resetAccumulatedStats(c10::DeviceIndex device) override { reset(device, false); }
  void reset(c10::DeviceIndex device, bool peak) {
    std::lock_guard<std::mutex> lock(mutex);
    auto& s = stats[check_device(device)];
    for (auto* stat : {&s.allocation[0], &s.allocated_bytes[0], &s.reserved_bytes[0]})
      peak ? stat->reset_peak() : stat->reset_accumulated();
  }
} allocator;

void MallocAllocator::release(void* context) {
  auto* a = static_cast<Allocation*>(context);
  {
    std::lock_guard<std::mutex> lock(allocator.mutex);
    allocator.count(a->device, a->size, false);
  }
  std::free(a->ptr);
  delete a;
}

// torch allocates every minidev tensor and storage with c10::GetAllocator(PrivateUse1).
struct RegisterAllocator {
  RegisterAllocator() { c10::SetAllocator(kType, &allocator); }
} register_allocator;
// [docs:end ALLOCATOR]

// [docs:start GUARD]
// Streams and events complete at once: every operator has finished when it returns, so a stream
// is only an id and an event only the time it was recorded at.
thread_local c10::StreamId current_stream[kDevices] = {};  // 0: the default stream
std::atomic<c10::StreamId> next_stream{1};

using Clock = std::chrono::steady_clock;

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device getDevice() const override {
    return device_of(current_device);
  }
  void setDevice(c10::Device d) const override { current_device = index_of(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kDevices) current_device = d.index();
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }

  c10::Stream stream(int device, c10::StreamId id) const {
    return c10::Stream(c10::Stream::UNSAFE, device_of(device), id);
  }
  c10::Stream getStream(c10::Device d) const override {
    return stream(index_of(d), current_stream[index_of(d)]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return stream(index_of(d), 0); }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return stream(index_of(d), next_stream++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    current_stream[index_of(s.device())] = s.id();
    return old;
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(c10::DeviceIndex) const override {}

  // An event's handle is the time it was last recorded at.
  void record(void** event, const c10::Stream& stream, c10::DeviceIndex,
              c10::EventFlag) const override {
    if (*event == nullptr) *event = new Clock::time_point();
    *static_cast<Clock::time_point*>(*event) = Clock::now();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void synchronizeEvent(void*) const override {}
  void destroyEvent(void* event, c10::DeviceIndex) const noexcept override {
    delete static_cast<Clock::time_point*>(event);
  }
  double elapsedTime(void* start, void* end, c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "minidev: both events must be recorded before elapsed_time");
    auto span = *static_cast<Clock::time_point*>(end) - *static_cast<Clock::time_point*>(start);
    return std::chrono::duration<double, std::milli>(span).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);
// [docs:end GUARD]

// [docs:start GENERATOR]
// A device generator owns a CPU generator: random operators run as CPU kernels, which draw from it.
struct Generator final : c10::GeneratorImpl {
  mutable at::Generator cpu = at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val);

  explicit Generator(int device) : c10::GeneratorImpl(device_of(device), kKeys) {}

  void set_current_seed(uint64_t seed) override {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_current_seed(seed);
  }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    return cpu.seed();
  }
  void set_state(const c10::TensorImpl& state) override {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.unsafeGetGeneratorImpl()->set_state(state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }
  void set_offset(uint64_t) override { TORCH_CHECK(false, "minidev generators have no offset"); }
  uint64_t get_offset() const override { TORCH_CHECK(false, "minidev generators have no offset"); }
  Generator* clone_impl() const override {
    auto* copy = new Generator(device().index());
    copy->cpu = cpu.clone();
    return copy;
  }
};

const at::Generator& default_generator(int device) {
  static at::Generator generators[kDevices] = {at::make_generator<Generator>(0),
                                               at::make_generator<Generator>(1)};
  return generators[check_device(device < 0 ? current_device : device)];
}

// The CPU generator a random operator on `device` draws from: that of the generator argument,
// or of the device's default generator.
at::Generator cpu_generator(const c10::IValue& arg, int device) {
  const at::Generator& g = arg.isNone() ? default_generator(device) : arg.toGenerator();
  TORCH_CHECK(g.device() == device_of(device), "expected a generator of minidev:", device,
              ", got one of ", g.device());
  return static_cast<Generator*>(g.unsafeGetGeneratorImpl())->cpu;
}
// [docs:end GENERATOR]

// [docs:start HOOKS]
void resize_bytes(c10::StorageImpl* storage, size_t size);
bool (*pinned_lookup)(const void*) = nullptr;  // optional/pinned_memory.cpp hands it over

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    return default_generator(device);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return at::make_generator<Generator>(check_device(device < 0 ? current_device : device));
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t size) const override {
    resize_bytes(storage.unsafeGetStorageImpl(), size);
  }
  // [docs:start PINNED_HOOKS]
  // Pinned memory (optional): without a host allocator, pin_memory() raises and nothing is pinned.
  c10::Allocator* getPinnedMemoryAllocator() const override {
    c10::Allocator* host = at::getHostAllocator(kType);  // nullptr when none is registered
    TORCH_CHECK_NOT_IMPLEMENTED(host, "minidev: no pinned memory (optional/pinned_memory.cpp)");
    return host;
  }
  bool isPinnedPtr(const void* p) const override { return pinned_lookup && pinned_lookup(p); }
  // [docs:end PINNED_HOOKS]
};

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }
} register_hooks;
// [docs:end HOOKS]

// [docs:start EMPTY]
at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                         std::optional<at::Device> device, std::optional<bool>) {
  c10::DeviceGuard guard(device_of(index_of(device.value_or(c10::Device(kType)))));
  return at::detail::empty_strided_generic(size, stride, &allocator, kKeys,
                                           dtype.value_or(at::get_default_dtype_as_scalartype()));
}

at::Tensor empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                 std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>,
                 std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(device_of(index_of(device.value_or(c10::Device(kType)))));
  const auto type = dtype.value_or(at::get_default_dtype_as_scalartype());
  return at::detail::empty_generic(size, &allocator, kKeys, type, memory_format);
}
// [docs:end EMPTY]

// [docs:start VIEWS]
// A view is a new TensorImpl on the same storage.
at::Tensor make_view(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                     std::optional<int64_t> offset) {
  auto view = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(self.storage()), self.key_set(), self.dtype());
  auto* impl = view.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(size, stride, offset.value_or(self.storage_offset()));
  return view;
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  auto shape = at::infer_size_dv(size, self.numel());
  auto stride = at::detail::computeStride(self.sizes(), self.strides(), shape);
  TORCH_CHECK(stride.has_value(), "view size is not compatible with input tensor's size and "
              "stride (at least one dimension spans across two contiguous subspaces). Use "
              ".reshape(...) instead.");
  return make_view(self, shape, *stride, self.storage_offset());
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return make_view(self, size, stride, self.storage_offset());
}
// [docs:end VIEWS]

// [docs:start STORAGE_BYTES]
// Grows or shrinks a storage in place: new device memory, the old bytes copied over. Storage
// resize_ reaches it through the hooks, tensor resize_ and set_ when they need more bytes.
void resize_bytes(c10::StorageImpl* storage, size_t size) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  c10::DeviceGuard guard(storage->device());
  at::DataPtr data = storage->allocator()->allocate(size);
  if (storage->nbytes() && size)
    allocator.copy_data(data.get(), storage->data(), std::min(size, storage->nbytes()));
  storage->set_data_ptr_noswap(std::move(data));
  storage->set_nbytes(size);
}

void ensure_bytes(const at::Tensor& self) {
  const size_t needed = at::detail::computeStorageNbytes(
      self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
  if (needed > self.storage().nbytes()) resize_bytes(self.storage().unsafeGetStorageImpl(), needed);
}
// [docs:end STORAGE_BYTES]

// [docs:start SET]
// torch.load rebuilds every tensor with this overload: an empty tensor, then
// set_(storage, offset, size, stride), so that views of one storage share it again.
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  if (stride.data() != nullptr) {
    impl->set_sizes_and_strides(size, stride, offset);
  } else {
    impl->set_sizes_contiguous(size);
    impl->set_storage_offset(offset);
  }
  ensure_bytes(self);
  return self;
}

at::Tensor& set_source(at::Tensor& self, c10::Storage source) {
  const int64_t size = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {size}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(),
                     source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, &allocator, /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

// [docs:end SET]

// [docs:start RESIZE]
const at::Tensor& resize_tensor(const at::Tensor& self, c10::IntArrayRef size,
                                std::optional<at::MemoryFormat> format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (format && *format != at::MemoryFormat::Preserve) impl->empty_tensor_restride(*format);
  ensure_bytes(self);
  return self;
}
// [docs:end RESIZE]

// [docs:start COPY]
// Device memory is host memory here: a copy is a CPU copy between CPU tensors that alias the
// device tensors (a real device calls its driver's copy: docs/minimal_ops.md).
at::Tensor as_cpu(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  as_cpu(dst).copy_(as_cpu(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_tensor(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}
// [docs:end COPY]

// [docs:start FALLBACK]
// Every other operator: PyTorch's cpu_fallback copies the device arguments to the CPU, runs the
// CPU kernel and copies the results back. Random operators first get the CPU generator of the
// device's generator, so that they draw from minidev's generators, not from the CPU's.
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  int device = current_device;
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    if (value.isTensor() && value.toTensor().device().type() == kType)
      device = value.toTensor().device().index();
    auto type = args[i].real_type();
    if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
    if (type->kind() == c10::TypeKind::GeneratorType) value = cpu_generator(value, device);
  }
  at::native::cpu_fallback(op, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", make_view);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_", set_empty);
  m.impl("resize_", resize_tensor);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("native_layer_norm", torch::CppFunction::makeFromBoxedFunction<&fallback>());
}
// [docs:end FALLBACK]

}  // namespace

// [docs:start PYTHON_BINDINGS]
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_count", [] { return kDevices; });
  m.def("default_generator", [](int device) { return default_generator(device); });
  m.def("set_pinned_lookup", [](py::capsule lookup) {
    pinned_lookup = reinterpret_cast<bool (*)(const void*)>(lookup.get_pointer());
  });
}
// [docs:end PYTHON_BINDINGS]
