// Native because: this is the per-operator hot path of the generic fallback.
#include "ops/cpu_kernel.h"

#include "adapters/autograd.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/flat_hash_map.h>

#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <memory>
#include <vector>

namespace openreg {
namespace {

// A DataPtr over memory owned by another storage: its context is a reference to that
// StorageImpl, so the memory outlives the DataPtr's holder (a CPU alias that a kernel keeps, or
// a device storage sharing a CPU result's memory). One reference count, no allocation.
void release_owner(void* ctx) {
  c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx));
}

c10::DataPtr data_ptr_owned_by(c10::StorageImpl* owner, c10::Device device) {
  c10::raw::intrusive_ptr::incref(owner);
  return c10::DataPtr(const_cast<void*>(owner->data()), owner, &release_owner, device);
}

c10::intrusive_ptr<c10::StorageImpl> make_cpu_alias_storage(const c10::Storage& device_storage) {
  auto* impl = device_storage.unsafeGetStorageImpl();
  c10::DataPtr ptr = data_ptr_owned_by(impl, c10::Device(c10::DeviceType::CPU));
  // Resizable through the CPU allocator: a kernel that grows an out= argument gets device
  // memory (allocations are redirected while a HostKernel is alive), adopted by sync_written.
  return c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), impl->nbytes(),
                                               std::move(ptr), c10::GetCPUAllocator(),
                                               /*resizable=*/true);
}

at::Tensor make_tensor_like(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                    like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  if (like.is_conj()) t._set_conj(true);
  if (like.is_neg()) t._set_neg(true);
  return t;
}

}  // namespace

at::Tensor make_device_tensor(c10::Storage storage, const at::Tensor& like) {
  return make_tensor_like(std::move(storage), c10::DispatchKey::PrivateUse1, like);
}

at::Tensor cpu_alias(const at::Tensor& t) {
  return make_tensor_like(c10::Storage(make_cpu_alias_storage(t.storage())), c10::DispatchKey::CPU,
                          t);
}

// [docs:start SESSION_INDEX]
// A session finds what it aliased by address: the alias of a device tensor (each is aliased
// once), the CPU storage of a device storage (tensors sharing a storage get aliases sharing one),
// the device tensor of a returned CPU tensor. A search through a list is the fastest for the few
// tensors of most operators; tensor-list operators (foreach, fused optimizers) pass hundreds,
// and searching for each one made a call cost O(n^2): 38% of the time of `_fused_adam_` on 4 x
// 100 tensors went to these searches (perf, docs/fallback.md). Beyond kLinear entries the
// session indexes them in a hash table. Sessions are pooled per thread and nesting level, so the
// lists and the table keep their memory from call to call instead of growing it again.
struct HostKernel::Session {
  struct AliasedTensor {
    at::Tensor cpu;
    at::Tensor device;
  };
  // Holding both storages keeps their addresses unique for the lifetime of the session.
  struct AliasedStorage {
    c10::Storage cpu;
    c10::Storage device;
  };
  enum Role : uintptr_t { DeviceTensor = 0, CpuTensor = 1, DeviceStorage = 2, CpuStorage = 3 };
  static constexpr size_t kLinear = 8;

  std::vector<AliasedTensor> tensors;
  std::vector<AliasedStorage> storages;
  // Address | role -> index in `tensors` or `storages` (objects are 8-byte aligned).
  ska::flat_hash_map<uintptr_t, uint32_t> index;
  bool indexed = false;

  static uintptr_t key(const void* p, Role r) { return reinterpret_cast<uintptr_t>(p) | r; }

  int find_tensor(const c10::TensorImpl* impl, Role r) const {
    if (indexed) {
      auto it = index.find(key(impl, r));
      return it == index.end() ? -1 : int(it->second);
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = r == DeviceTensor ? tensors[i].device : tensors[i].cpu;
      if (t.unsafeGetTensorImpl() == impl) return int(i);
    }
    return -1;
  }

  int find_storage(const c10::StorageImpl* impl, Role r) const {
    if (indexed) {
      auto it = index.find(key(impl, r));
      return it == index.end() ? -1 : int(it->second);
    }
    for (size_t i = 0; i < storages.size(); ++i) {
      const c10::Storage& st = r == DeviceStorage ? storages[i].device : storages[i].cpu;
      if (st.unsafeGetStorageImpl() == impl) return int(i);
    }
    return -1;
  }

  void index_tensor(size_t i) {
    index.emplace(key(tensors[i].device.unsafeGetTensorImpl(), DeviceTensor), uint32_t(i));
    index.emplace(key(tensors[i].cpu.unsafeGetTensorImpl(), CpuTensor), uint32_t(i));
  }
  void index_storage(size_t i) {
    index.emplace(key(storages[i].device.unsafeGetStorageImpl(), DeviceStorage), uint32_t(i));
    index.emplace(key(storages[i].cpu.unsafeGetStorageImpl(), CpuStorage), uint32_t(i));
  }
  void maybe_build_index() {
    if (indexed || tensors.size() + storages.size() <= kLinear) return;
    indexed = true;
    for (size_t i = 0; i < tensors.size(); ++i) index_tensor(i);
    for (size_t i = 0; i < storages.size(); ++i) index_storage(i);
  }

  void add_tensor(at::Tensor cpu, at::Tensor device) {
    tensors.push_back({std::move(cpu), std::move(device)});
    if (indexed) index_tensor(tensors.size() - 1);
    else maybe_build_index();
  }
  void add_storage(c10::Storage cpu, c10::Storage device) {
    storages.push_back({std::move(cpu), std::move(device)});
    if (indexed) index_storage(storages.size() - 1);
    else maybe_build_index();
  }

  void clear() {
    tensors.clear();
    storages.clear();
    if (indexed) {
      index.clear();
      indexed = false;
    }
  }
};

namespace {
thread_local std::vector<std::unique_ptr<HostKernel::Session>> t_sessions;
thread_local size_t t_depth = 0;  // sessions in use on this thread (nested HostKernels)
}  // namespace

HostKernel::Session* HostKernel::acquire_session() {
  if (t_depth == t_sessions.size()) t_sessions.push_back(std::make_unique<Session>());
  return t_sessions[t_depth++].get();
}

HostKernel::~HostKernel() {
  // Releases the aliases while the stream is still held and device memory still accessible
  // (strict mode), as the members' destruction did before sessions were pooled.
  s_->clear();
  --t_depth;
}
// [docs:end SESSION_INDEX]

// [docs:start HOST_KERNEL_ALIAS]
at::Tensor HostKernel::alias(const at::Tensor& t) {
  int found = s_->find_tensor(t.unsafeGetTensorImpl(), Session::DeviceTensor);
  if (found >= 0) return s_->tensors[found].cpu;
  const c10::Storage& storage = t.storage();
  c10::Storage cpu_storage;
  int st = s_->find_storage(storage.unsafeGetStorageImpl(), Session::DeviceStorage);
  if (st >= 0) {
    cpu_storage = s_->storages[st].cpu;
  } else {
    cpu_storage = c10::Storage(make_cpu_alias_storage(storage));
    s_->add_storage(cpu_storage, storage);
  }
  at::Tensor cpu = make_tensor_like(std::move(cpu_storage), c10::DispatchKey::CPU, t);
  s_->add_tensor(cpu, t);
  return cpu;
}
// [docs:end HOST_KERNEL_ALIAS]

void HostKernel::sync_written(const at::Tensor& t) {
  int found = s_->find_tensor(t.unsafeGetTensorImpl(), Session::DeviceTensor);
  if (found < 0) return;
  sync_written(t, s_->tensors[found].cpu);
}

void HostKernel::sync_written(const at::Tensor& t, const at::Tensor& cpu) {
  auto* timpl = t.unsafeGetTensorImpl();
  auto* cpu_storage = cpu.storage().unsafeGetStorageImpl();
  auto* dev_storage = t.storage().unsafeGetStorageImpl();
  if (cpu_storage->data() != dev_storage->data() || cpu_storage->nbytes() != dev_storage->nbytes()) {
    // The kernel resized the argument: its new memory was allocated on the device (redirected
    // CPU allocation); move it into the device storage, which all views of it share.
    c10::DataPtr fresh =
        cpu_storage->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU)));
    size_t nbytes = cpu_storage->nbytes();
    if (fresh.get() != nullptr && !is_device_memory(fresh)) {
      c10::DataPtr copy = allocate_on_device(device_, nbytes);
      std::memcpy(copy.get(), fresh.get(), nbytes);
      fresh = std::move(copy);
    }
    fresh.unsafe_set_device(
        c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_)));
    dev_storage->set_data_ptr_noswap(std::move(fresh));
    dev_storage->set_nbytes(nbytes);
    // Point the alias at the device memory again, for results that view it.
    cpu_storage->set_data_ptr_noswap(
        data_ptr_owned_by(dev_storage, c10::Device(c10::DeviceType::CPU)));
  }
  if (cpu.sizes() != t.sizes() || cpu.strides() != t.strides() ||
      cpu.storage_offset() != t.storage_offset()) {
    timpl->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
  }
  // Kernels may set the conjugate or negative bit of an out= argument (the bits are metadata of
  // the tensor, not of the memory): the device tensor gets them too.
  if (cpu.is_conj() != t.is_conj()) timpl->_set_conj(cpu.is_conj());
  if (cpu.is_neg() != t.is_neg()) timpl->_set_neg(cpu.is_neg());
}

c10::Storage HostKernel::device_storage_for(const at::Tensor& cpu) {
  const c10::Storage& storage = cpu.storage();
  auto* impl = storage.unsafeGetStorageImpl();
  int found = s_->find_storage(impl, Session::CpuStorage);
  if (found >= 0) return s_->storages[found].device;  // an argument's, or seen before
  c10::Device dev(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_));
  size_t nbytes = impl->nbytes();
  c10::DataPtr ptr;
  const c10::DataPtr& original = impl->data_ptr();
  if (is_device_memory(original) && storage.use_count() == 1) {
    // Allocated by the kernel from device memory (redirected CPU allocation): adopt it.
    ptr = impl->set_data_ptr(c10::DataPtr(nullptr, original.device()));
    ptr.unsafe_set_device(dev);
  } else if (is_device_memory(original)) {
    // Device memory still referenced elsewhere: share it, keeping the CPU storage alive.
    ptr = data_ptr_owned_by(impl, dev);
  } else {
    // Memory the kernel did not get from the allocator (static or external): copy it.
    ptr = allocate_on_device(device_, nbytes);
    if (nbytes > 0) std::memcpy(ptr.get(), impl->data(), nbytes);
  }
  c10::Storage result(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, std::move(ptr), allocator_for_device(device_),
      /*resizable=*/true));
  s_->add_storage(storage, result);
  return result;
}

// [docs:start HOST_KERNEL_RESULT]
at::Tensor HostKernel::result(const at::Tensor& cpu) {
  if (!cpu.defined()) return cpu;
  int found = s_->find_tensor(cpu.unsafeGetTensorImpl(), Session::CpuTensor);
  if (found >= 0) {
    at::Tensor device = s_->tensors[found].device;
    sync_written(device, s_->tensors[found].cpu);
    return device;  // in-place and out= kernels return their argument itself
  }
  return make_device_tensor(device_storage_for(cpu), cpu);
}
// [docs:end HOST_KERNEL_RESULT]

// [docs:start KERNEL_THREADS]
// Backward on openreg runs on the autograd engine's worker thread for the device (named
// "pt_autograd_<device>"), as on CUDA; forward and the optimizer run on the caller's thread. Each
// thread that runs a parallel CPU kernel gets its own OpenMP team, and an OpenMP worker spins
// for a while after each parallel region before it sleeps. With two teams in one training step,
// each phase competes with the other team's spinning workers: measured on 2 cores, the MLP step
// went from 1.8 ms to 3.4 ms and every phase slowed down, not only backward (DESIGN.md pitfall
// 1). So kernels on the autograd threads run with one OpenMP thread: no second team exists.
// (Giving large kernels the full team was measured too: it sped up the CNN's convolution
// backward, but the second team's spinning then slowed the rest of the process 2x.)
// OPENREG_AUTOGRAD_OMP_THREADS=<n> sets another count; 0 leaves torch's setting.
void configure_kernel_thread() {
  if (!is_autograd_worker_thread()) return;
  int threads = 1;
  if (const char* env = std::getenv("OPENREG_AUTOGRAD_OMP_THREADS")) threads = std::atoi(env);
  if (threads <= 0) return;
  // This thread's team only (at::set_num_threads would change it for the whole process), in
  // the OpenMP runtime torch is linked with.
  using SetNumThreads = void (*)(int);
  auto set_num_threads = reinterpret_cast<SetNumThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set_num_threads != nullptr) set_num_threads(threads);
}
// [docs:end KERNEL_THREADS]

}  // namespace openreg
