// Native because: this is the per-operator hot path of the generic fallback.
#include "ops/cpu_kernel.h"

#include "runtime/device_profile.h"

#include "adapters/autograd.h"
#include "routes/call_counter.h"

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/flat_hash_map.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <iterator>
#include <typeinfo>
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


}  // namespace

at::Tensor make_tensor_like(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                    like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  if (like.is_conj()) t._set_conj(true);
  if (like.is_neg()) t._set_neg(true);
  return t;
}

at::Tensor make_device_tensor(c10::Storage storage, const at::Tensor& like) {
  return make_tensor_like(std::move(storage), c10::DispatchKey::PrivateUse1, like);
}

namespace {
// [docs:start ALIAS_NOT_INFERENCE]
// A CPU alias is never an inference tensor, whatever the mode it is made in: a cached alias
// outlives the call (ALIAS_CACHE), and one made inside torch.inference_mode() would carry a
// disabled version counter into a later call outside it, where an in-place kernel on it raised
// "Inplace update to inference tensor outside InferenceMode" for a normal device tensor. Inside
// the mode a normal alias is what the CPU kernel gets for a normal tensor there anyway, and
// whether the device tensor itself may be updated was decided before the call, on the device
// tensor.
at::Tensor make_alias(c10::Storage storage, const at::Tensor& like) {
  if (C10_UNLIKELY(c10::InferenceMode::is_enabled())) {
    c10::InferenceMode normal(false);
    return make_tensor_like(std::move(storage), c10::DispatchKey::CPU, like);
  }
  return make_tensor_like(std::move(storage), c10::DispatchKey::CPU, like);
}
// [docs:end ALIAS_NOT_INFERENCE]
}  // namespace

at::Tensor cpu_alias(const at::Tensor& t) {
  return make_alias(c10::Storage(make_cpu_alias_storage(t.storage())), t);
}

// [docs:start ALIAS_CACHE]
// The alias of a device tensor outlives the call: each thread keeps, per device tensor it has
// passed to a kernel, the CPU tensor it built for it, and the next call revalidates it against the
// device tensor (storage memory and size, sizes, strides, offset, dtype, conjugate and negative
// bits) and updates it in place instead of building a new one. Building an alias (a TensorImpl and
// a StorageImpl) and destroying it was most of what a tensor in a list costs (docs/fallback.md).
//  * Identity: the key is the device TensorImpl's address, and the entry holds a weak reference
//    to it, which keeps that address from being reused while the entry exists: an entry found
//    for a live tensor is that tensor's.
//  * Memory: a cached alias does not own the device memory (its storage borrows the pointer), so
//    the cache never keeps device memory alive; it is used only while the device tensor, alive
//    and checked to have that memory, is an argument of the call.
//  * A kernel that keeps an alias beyond the call (a result viewing an argument goes through the
//    session as before; any other reference, the arguments left on the stack by a failing kernel
//    included) is found when the call ends by its reference counts: the alias then takes a
//    reference to the device storage, as every alias did before, and leaves the cache.
//  * Threads: the cache is per thread, so two threads using the same device tensor at once (a
//    weight read by the caller and the autograd device thread) never share an alias. Within a
//    thread an entry in use (nested kernels) is not handed out twice: the inner call builds a
//    fresh alias.
//  * Size: most tensors an operator sees for the first time die young (a loop's temporaries);
//    the entries made since the last look (kYoung of them) are looked at again when the next
//    kYoung have been made, and those whose tensor died leave the cache. The whole cache is swept
//    once it doubles in size (kMinSweep entries at the least), for the entries that died old.
//    (Before, only the whole sweep, at 1,024 entries or twice the live ones: LBFGS's tiny
//    operators on fresh tensors kept about a thousand dead tensors' entries, aliases and
//    TensorImpls around between sweeps, their memory spread over the caches.)
//  * A swept entry keeps its alias (up to kSpareAliases of them): the next tensor seen for the
//    first time takes the entry and revalidates the alias, as a take-over does, instead of
//    making a TensorImpl and a StorageImpl.
//  * Reuse: a tensor seen for the first time takes over the entry of a tensor that died, if one
//    of the last few entries made or taken over is such (a chain `y = y + x` passes each result
//    once, and the previous one has died by then): its alias is revalidated for the new tensor
//    instead of a TensorImpl, a StorageImpl and an entry being made, and the cache stays small.
struct HostKernel::AliasCache {
  struct Entry {
    Entry() : device(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()) {}
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> device;
    const c10::TensorImpl* key = nullptr;  // the device tensor's, while `device` keeps the address
                                           // taken; nullptr: a spare entry
    at::Tensor cpu;
    c10::Storage storage;  // the storage made for `cpu`, borrowing the device memory
    // The session the alias is handed out to (nullptr: free). A call finds a tensor it passes
    // twice by this mark, without a search.
    const HostKernel::Session* owner = nullptr;
    bool young = false;  // listed in `young`
    // The alias is over `storage` and held by nothing but this entry (its references: the
    // tensor, and the storage through the entry and the tensor).
    bool alias_only_here() const {
      return cpu.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl() ==
                 storage.unsafeGetStorageImpl() &&
             cpu.use_count() == 1 && storage.use_count() == 2;
    }
  };
  ska::flat_hash_map<const c10::TensorImpl*, Entry*> entries;
  // Entries are never freed, only made spare: a call site's memo (ALIAS_MEMO) may point to an
  // entry that left the cache, and finds it spare or another tensor's by its key.
  std::deque<Entry> pool;
  std::vector<Entry*> spare;
  std::vector<Entry*> spare_with_alias;  // swept entries that kept their alias
  std::vector<Entry*> young;  // made or taken over since the last look; may list spare entries
  static constexpr size_t kYoung = 64;
  static constexpr size_t kMinSweep = 256;
  static constexpr size_t kSpareAliases = 256;
  size_t sweep_at = kMinSweep;
  // The entries made or taken over last (valid until an entry is erased: then cleared).
  static constexpr size_t kRecent = 4;
  Entry* recent[kRecent] = {};
  size_t next_recent = 0;

  void remember(Entry* e) { recent[next_recent++ % kRecent] = e; }
  void note_young(Entry* e) {
    if (e->young) return;
    e->young = true;
    young.push_back(e);
  }
  void forget_recent() { std::fill(std::begin(recent), std::end(recent), nullptr); }

  // An entry for `t`, with the alias a swept entry kept if there is one (to be revalidated).
  Entry* make(const at::Tensor& t) {
    Entry* e;
    if (!spare_with_alias.empty()) {
      e = spare_with_alias.back();
      spare_with_alias.pop_back();
    } else if (!spare.empty()) {
      e = spare.back();
      spare.pop_back();
    } else {
      e = &pool.emplace_back();
    }
    e->device = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
        t.getIntrusivePtr());
    e->key = t.unsafeGetTensorImpl();
    entries.emplace(e->key, e);
    note_young(e);
    return e;
  }
  // Out of the map first, then the weak reference that kept the key's address goes. The alias
  // is kept if asked and nothing else holds it (the entry's own references only: the tensor and
  // its storage, whose TensorImpl also holds it).
  void release(Entry* e, bool keep_alias = false) {
    e->device.reset();
    e->key = nullptr;
    e->owner = nullptr;
    if (keep_alias && spare_with_alias.size() < kSpareAliases && e->cpu.defined() &&
        e->alias_only_here()) {
      spare_with_alias.push_back(e);
      return;
    }
    e->cpu.reset();
    e->storage = c10::Storage();
    spare.push_back(e);
  }
  void erase(const c10::TensorImpl* key) {
    auto it = entries.find(key);
    Entry* e = it->second;
    entries.erase(it);
    release(e);
  }

  // A recent entry whose device tensor died, now `t`'s; nullptr if there is none.
  Entry* take_over(const at::Tensor& t) {
    for (Entry* e : recent) {
      if (e == nullptr || e->owner != nullptr || !e->device.expired()) continue;
      entries.erase(e->key);
      // The old key is erased before the weak reference that kept its address goes.
      e->device = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
          t.getIntrusivePtr());
      e->key = t.unsafeGetTensorImpl();
      entries.emplace(e->key, e);
      note_young(e);
      return e;
    }
    return nullptr;
  }

  // The entries made or taken over since the last look: those whose tensor died leave.
  void sweep_young() {
    bool released = false;
    for (Entry* e : young) {  // each listed once (its mark); a spare one has no key
      e->young = false;
      if (e->key != nullptr && e->owner == nullptr && e->device.expired()) {
        entries.erase(e->key);
        release(e, /*keep_alias=*/true);
        released = true;
      }
    }
    young.clear();
    if (released) forget_recent();  // a released entry must not be taken over
  }

  void sweep() {
    forget_recent();
    for (auto it = entries.begin(); it != entries.end();) {
      Entry* e = it->second;
      if (e->owner == nullptr && e->device.expired()) {
        it = entries.erase(it);
        release(e, /*keep_alias=*/true);
      } else {
        ++it;
      }
    }
    sweep_at = std::max<size_t>(kMinSweep, 2 * entries.size());
  }
};
// [docs:end ALIAS_CACHE]

// [docs:start ADDRESS_INDEX]
// Address -> position, for a session's index. Open addressing with linear probing, and cleared in
// O(1): a slot belongs to the current call only if it carries the call's generation. (A hash
// table cleared slot by slot cost 5% of `_fused_adam_` on 100 tensors: after a call of 2,000
// entries each call swept 4,096 slots, however few it used.)
class AddressIndex {
 public:
  int find(uintptr_t key) const {
    if (slots_.empty()) return -1;
    const size_t mask = slots_.size() - 1;
    for (size_t i = hash(key) & mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.gen != gen_) return -1;
      if (s.key == key) return int(s.value);
    }
  }
  // Keeps the first position given for a key: returns it, or -1 if `value` was inserted.
  int insert(uintptr_t key, uint32_t value) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    const size_t mask = slots_.size() - 1;
    for (size_t i = hash(key) & mask;; i = (i + 1) & mask) {
      Slot& s = slots_[i];
      if (s.gen != gen_) {
        s = {key, value, gen_};
        ++size_;
        return -1;
      }
      if (s.key == key) return int(s.value);
    }
  }
  void clear() {
    size_ = 0;
    if (++gen_ == 0) {  // wrapped around: forget every slot for real, once in 4 billion calls
      for (Slot& s : slots_) s.gen = 0;
      gen_ = 1;
    }
  }

 private:
  struct Slot {
    uintptr_t key;
    uint32_t value;
    uint32_t gen;  // 0: never used
  };
  static size_t hash(uintptr_t key) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    return size_t(h ^ (h >> 29));
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(std::max<size_t>(64, 2 * old.size()), Slot{0, 0, 0});
    size_ = 0;
    for (const Slot& s : old)
      if (s.gen == gen_) insert(s.key, s.value);
  }

  std::vector<Slot> slots_;  // a power of two
  size_t size_ = 0;
  uint32_t gen_ = 1;
};
// [docs:end ADDRESS_INDEX]

// [docs:start ALIAS_MEMO]
// What a call site's last call aliased, in order (on this thread): a tensor-list operator called
// again on the same lists (an optimizer step, each step on the same parameters and states) finds
// each tensor's cached alias here instead of looking it up, and knows its storage is not another
// argument's without probing the session's index. A tensor matches its record if it is the same
// TensorImpl, with the same StorageImpl, and the record's cache entry is still that tensor's (its
// key) and free; its alias is then revalidated as any cached alias (revalidate), so a tensor
// changed in place between calls gets a correct alias.
//  * Only a prefix of the call matches: from the first tensor that does not, the call takes the
//    ordinary path and records what it finds, until a tensor that did not get a cached alias with
//    a storage of its own (a tensor twice, views of one storage, nested calls): the records are
//    always tensors whose storages were pairwise distinct, so tensors matching them position by
//    position (same live StorageImpls) have distinct storages too.
//  * Entries are never freed (AliasCache::pool), so a record's entry can be read whatever became
//    of it; one that left the cache has no key, one taken over has another tensor's.
//  * A memo serves one HostKernel at a time (a nested call at the same site goes without).
struct HostKernel::AliasMemo {
  struct Record {
    const c10::TensorImpl* device;
    const c10::StorageImpl* device_storage;
    AliasCache::Entry* entry;
  };
  std::vector<Record> records;
  size_t next = 0;         // the position of the call's next alias
  size_t matched = 0;      // aliases found in the memo, once the call stopped matching
  bool matching = true;    // the call's aliases so far were records[0, next)
  bool recording = true;   // ... or were recorded
  bool in_use = false;

  void start() {
    in_use = true;
    next = 0;
    matching = recording = true;
  }
  void record(const c10::TensorImpl* t, const c10::StorageImpl* storage, AliasCache::Entry* e) {
    if (!recording) return;
    records.push_back({t, storage, e});
    ++next;
  }
};
// [docs:end ALIAS_MEMO]

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
  // Reference counts are atomic, and a tensor-list operator would pay several per tensor: the
  // session holds the device tensors (a boxed caller's stack may have held their only
  // reference), but only borrows what is held anyway while the call runs: the cache's aliases
  // (held by their entries) and the storages of aliases and of device tensors.
  struct AliasedTensor {
    // Built in place (emplace_back): a temporary copied in was a visible share of alias().
    AliasedTensor(at::Tensor&& owned, AliasCache::Entry* entry, at::Tensor&& device,
                  c10::StorageImpl* device_storage)
        : owned(std::move(owned)), entry(entry), device(std::move(device)),
          device_storage(device_storage) {}
    at::Tensor owned;                      // an alias made for this call
    AliasCache::Entry* entry = nullptr;    // or a cached alias handed out to this call
    at::Tensor device;
    c10::StorageImpl* device_storage;      // the device storage a cached alias borrows from
    const at::Tensor& cpu() const { return entry != nullptr ? entry->cpu : owned; }
  };
  struct AliasedStorage {
    c10::StorageImpl* cpu;
    c10::StorageImpl* device;
  };
  enum Role : uintptr_t { DeviceTensor = 0, CpuTensor = 1, DeviceStorage = 2, CpuStorage = 3 };
  static constexpr size_t kLinear = 8;

  explicit Session(AliasCache* cache) : aliases(cache) {}

  AliasCache* const aliases;  // this thread's
  std::vector<AliasedTensor> tensors;
  std::vector<AliasedStorage> storages;
  // The storages of results, held for the session: their addresses stay unique while it runs.
  std::vector<c10::Storage> held;
  size_t checked_out = 0;  // tensors with a cached alias (an entry marked with this session)
  // Address | role -> index in `tensors` or `storages` (objects are 8-byte aligned). Each side is
  // indexed only once it is looked up with more than kLinear entries: every alias looks up the
  // device storages (shared storages get one CPU storage); the device tensors are looked up only
  // for tensors the cache did not give (a cached alias handed to this call carries the session's
  // mark) and by the boxed fallback's write-back; the CPU side only to turn results back into
  // device tensors, so in-place tensor-list operators (foreach, fused optimizers), which return
  // nothing, index one key per tensor.
  AddressIndex index;
  bool device_tensors_indexed = false;
  bool device_storages_indexed = false;
  bool cpu_indexed = false;
  // Tensors of `tensors` whose alias is not a cache entry marked with this session.
  size_t uncached = 0;
  // The device tensors are borrowed, not held: their caller holds them for the call
  // (HostKernel::caller_holds_arguments).
  bool borrow_devices = false;

  static uintptr_t key(const void* p, Role r) { return reinterpret_cast<uintptr_t>(p) | r; }

  int find_tensor(const c10::TensorImpl* impl, Role r) {
    if (r == DeviceTensor ? (device_tensors_indexed || tensors.size() > kLinear)
                          : (cpu_indexed || tensors.size() + storages.size() > kLinear)) {
      if (r == DeviceTensor) index_device_tensors();
      else index_cpu_side();
      return index.find(key(impl, r));
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = r == DeviceTensor ? tensors[i].device : tensors[i].cpu();
      if (t.unsafeGetTensorImpl() == impl) return int(i);
    }
    return -1;
  }

  int find_storage(const c10::StorageImpl* impl, Role r) {
    if (r == DeviceStorage ? (device_storages_indexed || storages.size() > kLinear)
                           : (cpu_indexed || tensors.size() + storages.size() > kLinear)) {
      if (r == DeviceStorage) index_device_storages();
      else index_cpu_side();
      return index.find(key(impl, r));
    }
    for (size_t i = 0; i < storages.size(); ++i) {
      if ((r == DeviceStorage ? storages[i].device : storages[i].cpu) == impl) return int(i);
    }
    return -1;
  }

  // The position of the device storage among the session's storages; if it has none, -1, and
  // the caller adds it next (add_storage) with `claimed`: one probe of the index, not two.
  int claim_device_storage(const c10::StorageImpl* impl, bool& claimed) {
    claimed = false;
    if (!device_storages_indexed && storages.size() < kLinear) return find_storage(impl, DeviceStorage);
    index_device_storages();
    int found = index.insert(key(impl, DeviceStorage), uint32_t(storages.size()));
    claimed = found < 0;
    return found;
  }

  void index_device_tensors() {
    if (device_tensors_indexed) return;
    device_tensors_indexed = true;
    for (size_t i = 0; i < tensors.size(); ++i)
      index.insert(key(tensors[i].device.unsafeGetTensorImpl(), DeviceTensor), uint32_t(i));
  }
  void index_device_storages() {
    if (device_storages_indexed) return;
    device_storages_indexed = true;
    for (size_t i = 0; i < storages.size(); ++i)
      index.insert(key(storages[i].device, DeviceStorage), uint32_t(i));
  }
  void index_cpu_side() {
    if (cpu_indexed) return;
    cpu_indexed = true;
    for (size_t i = 0; i < tensors.size(); ++i)
      index.insert(key(tensors[i].cpu().unsafeGetTensorImpl(), CpuTensor), uint32_t(i));
    for (size_t i = 0; i < storages.size(); ++i)
      index.insert(key(storages[i].cpu, CpuStorage), uint32_t(i));
  }
  void index_tensor(size_t i) {
    if (device_tensors_indexed)
      index.insert(key(tensors[i].device.unsafeGetTensorImpl(), DeviceTensor), uint32_t(i));
    if (cpu_indexed)
      index.insert(key(tensors[i].cpu().unsafeGetTensorImpl(), CpuTensor), uint32_t(i));
  }

  at::Tensor hold(const at::Tensor& device) const {
    return borrow_devices ? c10::MaybeOwnedTraits<at::Tensor>::createBorrow(device) : device;
  }
  void add_tensor(at::Tensor cpu, const at::Tensor& device) {
    tensors.emplace_back(std::move(cpu), nullptr, hold(device), nullptr);
    ++uncached;
    index_tensor(tensors.size() - 1);
  }
  // An alias of the cache whose entry is marked with this session.
  void add_cached_tensor(AliasCache::Entry* e, const at::Tensor& device,
                         c10::StorageImpl* device_storage) {
    tensors.emplace_back(at::Tensor(), e, hold(device), device_storage);
    ++checked_out;
    index_tensor(tensors.size() - 1);
  }
  // Both storages must stay alive until the session ends (see `held`).
  void add_storage(c10::StorageImpl* cpu, c10::StorageImpl* device, bool claimed = false) {
    const size_t i = storages.size();
    storages.push_back({cpu, device});
    if (device_storages_indexed && !claimed) index.insert(key(device, DeviceStorage), uint32_t(i));
    if (cpu_indexed) index.insert(key(cpu, CpuStorage), uint32_t(i));
  }

  void clear() {
    // The call's own aliases and the results go first, so that the cached aliases' reference
    // counts show only who else kept them; the device tensors go last.
    if (uncached != 0)
      for (AliasedTensor& a : tensors) a.owned.reset();
    held.clear();
    if (checked_out != 0) return_cached();
    if (borrow_devices) {
      for (AliasedTensor& a : tensors) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(a.device);
      borrow_devices = false;
    }
    tensors.clear();
    storages.clear();
    uncached = 0;
    if (device_tensors_indexed || device_storages_indexed || cpu_indexed) {
      index.clear();
      device_tensors_indexed = device_storages_indexed = cpu_indexed = false;
    }
  }

  void return_cached();
};

namespace {
// What a thread keeps for its kernels, reached through one pointer (t_kernel below).
struct KernelThread {
  ~KernelThread();  // clears t_kernel (below)
  std::vector<std::unique_ptr<HostKernel::Session>> sessions;
  size_t depth = 0;  // sessions in use on this thread (nested HostKernels)
  bool configured = false;
  std::unique_ptr<HostKernel::AliasCache> aliases = std::make_unique<HostKernel::AliasCache>();
  std::vector<std::unique_ptr<HostKernel::AliasMemo>> memos;  // by call site
};
std::atomic<int> g_memo_sites{0};
// Aliases found through a memo, for tests (torch_openreg._C._route_calls("unboxed.memo")).
std::atomic<int64_t>& g_memo_aliases = call_counter("unboxed.memo");
// Swept entries' aliases revalidated for new tensors, for tests ("unboxed.spare_alias").
std::atomic<int64_t>& g_spare_aliases = call_counter("unboxed.spare_alias");
// Conjugate and negative bits, compared in one step.
const uint64_t kMathBits = (c10::DispatchKeySet(c10::DispatchKey::Conjugate) |
                            c10::DispatchKeySet(c10::DispatchKey::Negative)).raw_repr();
// A kernel call reaches its thread's state in one TLS lookup: t_kernel is a plain pointer,
// initialized to a constant, so reading it needs no initialization guard. A thread_local with a
// constructor (as KernelThread itself) goes through the compiler's guard function (__tls_init) on
// every use: as one, the state cost a tiny add 3 of its 22 __tls_get_addr calls, and 2 calls of
// __tls_init. The state is made at the thread's first kernel and owned by t_kernel_owner, which
// is touched only then; its destructor runs when the thread exits.
thread_local KernelThread* t_kernel = nullptr;
thread_local std::unique_ptr<KernelThread> t_kernel_owner;

KernelThread* new_kernel_thread() {
  t_kernel_owner = std::make_unique<KernelThread>();
  return t_kernel = t_kernel_owner.get();
}

// At thread exit: a kernel after this (from another thread_local's destructor) makes new state
// instead of using the freed one.
KernelThread::~KernelThread() { t_kernel = nullptr; }

inline KernelThread& kernel_thread() {
  KernelThread* k = t_kernel;
  return k != nullptr ? *k : *new_kernel_thread();
}

// The deleter of memory a cached alias borrows: never called (the DataPtr has no context).
void borrowed_memory(void*) {}

bool borrows(const c10::StorageImpl* storage) {
  return storage->data_ptr().get_deleter() == &borrowed_memory;
}

c10::DataPtr borrow(const c10::StorageImpl* device_storage) {
  return c10::DataPtr(const_cast<void*>(device_storage->data()), nullptr, &borrowed_memory,
                      c10::Device(c10::DeviceType::CPU));
}

// Sizes, strides and offset equal: a loop over the few dimensions of a tensor, inlined (the
// comparisons of IntArrayRefs call memcmp, a visible share of a tensor-list operator's time).
inline bool same_layout(const c10::TensorImpl& a, const c10::TensorImpl& b) {
  const int64_t n = a.dim();
  if (n != b.dim() || a.storage_offset() != b.storage_offset()) return false;
  const int64_t* as = a.sizes().data();
  const int64_t* bs = b.sizes().data();
  const int64_t* ast = a.strides().data();
  const int64_t* bst = b.strides().data();
  for (int64_t i = 0; i < n; ++i)
    if (as[i] != bs[i] || ast[i] != bst[i]) return false;
  return true;
}

// The same for tensors known to have the default size policy (plain TensorImpls, see
// ALIAS_MEMO): the fields read as stored. Through the public accessors, each of which checks the
// policy and may call a virtual function, the comparison above is about 80 instructions; a
// tensor-list operator pays it for every tensor of every call.
struct StoredLayout : c10::TensorImpl {
  static constexpr auto sizes_and_strides() { return &StoredLayout::sizes_and_strides_; }
  static constexpr auto storage_offset() { return &StoredLayout::storage_offset_; }
};
inline bool same_stored_layout(const c10::TensorImpl& a, const c10::TensorImpl& b) {
  const c10::impl::SizesAndStrides& as = a.*StoredLayout::sizes_and_strides();
  const c10::impl::SizesAndStrides& bs = b.*StoredLayout::sizes_and_strides();
  const size_t n = as.size();
  if (n != bs.size() || a.*StoredLayout::storage_offset() != b.*StoredLayout::storage_offset())
    return false;
  const int64_t* asz = as.sizes_data();
  const int64_t* bsz = bs.sizes_data();
  const int64_t* ast = as.strides_data();
  const int64_t* bst = bs.strides_data();
  for (size_t i = 0; i < n; ++i)
    if (asz[i] != bsz[i] || ast[i] != bst[i]) return false;
  return true;
}

// A TensorImpl of the default size policy for as long as it lives: not a subclass, not a Python
// wrapper (the two ways a tensor gets custom sizes or strides).
inline bool plain_tensor_impl(const c10::TensorImpl& t) {
  return typeid(t) == typeid(c10::TensorImpl) && !t.key_set().has(c10::DispatchKey::Python);
}
}  // namespace

int HostKernel::new_memo_site() { return g_memo_sites.fetch_add(1); }

HostKernel::Session* HostKernel::acquire_session(int memo_site, AliasMemo*& memo) {
  KernelThread& k = kernel_thread();
  if (!k.configured) {  // a field of the thread's state: no call per kernel once configured
    k.configured = true;
    configure_kernel_thread();
  }
  if (memo_site >= 0) {
    if (size_t(memo_site) >= k.memos.size()) k.memos.resize(memo_site + 1);
    std::unique_ptr<AliasMemo>& m = k.memos[memo_site];
    if (m == nullptr) m = std::make_unique<AliasMemo>();
    if (!m->in_use) {
      m->start();
      memo = m.get();
    }
  }
  if (k.depth == k.sessions.size())
    k.sessions.push_back(std::make_unique<Session>(k.aliases.get()));
  return k.sessions[k.depth++].get();
}

void HostKernel::caller_holds_arguments() {
  TORCH_INTERNAL_ASSERT(s_->tensors.empty(), "caller_holds_arguments after the first alias");
  s_->borrow_devices = true;
}

HostKernel::~HostKernel() {
  // Releases the aliases while the stream is still held and device memory still accessible
  // (strict mode), as the members' destruction did before sessions were pooled.
  s_->clear();
  if (memo_ != nullptr) {
    memo_->in_use = false;
    const size_t matched = memo_->matching ? memo_->next : memo_->matched;
    if (matched != 0) g_memo_aliases.fetch_add(int64_t(matched), std::memory_order_relaxed);
  }
  --t_kernel->depth;
}
// [docs:end SESSION_INDEX]

// [docs:start ALIAS_CACHE_RETURN]
// At the end of the call the session has dropped its references: an alias held only by its cache
// entry (and its storage only by the entry and the alias) goes back to the cache. Anything else
// kept it: it then owns a reference to the device storage, like an alias made for one call, and
// leaves the cache.
void HostKernel::Session::return_cached() {
  for (AliasedTensor& a : tensors) {
    AliasCache::Entry* e = a.entry;
    if (e == nullptr) continue;
    e->owner = nullptr;
    c10::StorageImpl* storage = e->storage.unsafeGetStorageImpl();
    if (e->alias_only_here() && borrows(storage)) continue;
    if (borrows(storage))
      storage->set_data_ptr_noswap(
          data_ptr_owned_by(a.device_storage, c10::Device(c10::DeviceType::CPU)));
    aliases->erase(a.device.unsafeGetTensorImpl());
    aliases->forget_recent();
  }
  checked_out = 0;
}
// [docs:end ALIAS_CACHE_RETURN]

namespace {
// A cached alias made to match its device tensor again: storage memory and size, dtype, sizes,
// strides, offset, conjugate and negative bits, each updated in place if it changed.
C10_NOINLINE void revalidate(HostKernel::AliasCache::Entry& e, const at::Tensor& device,
                             const c10::StorageImpl* dev_storage) {
  const c10::TensorImpl& t = *device.unsafeGetTensorImpl();
  c10::StorageImpl* cs = e.storage.unsafeGetStorageImpl();
  if (cs->data() != dev_storage->data() || cs->nbytes() != dev_storage->nbytes()) {
    cs->set_data_ptr_noswap(borrow(dev_storage));
    cs->set_nbytes(dev_storage->nbytes());
  }
  c10::TensorImpl* cimpl = e.cpu.unsafeGetTensorImpl();
  if (cimpl->dtype() != t.dtype()) {
    e.cpu = make_alias(e.storage, device);
  } else {
    // (The alias is a plain TensorImpl, made by make_alias.)
    if (!(plain_tensor_impl(t) ? same_stored_layout(*cimpl, t) : same_layout(*cimpl, t)))
      cimpl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    if (cimpl->is_conj() != t.is_conj()) cimpl->_set_conj(t.is_conj());
    if (cimpl->is_neg() != t.is_neg()) cimpl->_set_neg(t.is_neg());
  }
}
}  // namespace

// [docs:start ALIAS_MEMO_MATCH]
// A tensor of a call whose aliases so far all matched the memo: if it matches its record too, its
// cached alias is handed out here (revalidated as on the ordinary path, only faster while nothing
// changed); otherwise the call goes on by the ordinary path, which records.
const at::Tensor& HostKernel::alias_ref(const at::Tensor& t) {
  AliasMemo* m = memo_;
  if (m != nullptr && m->matching) {
    const c10::TensorImpl* timpl = t.unsafeGetTensorImpl();
    c10::StorageImpl* ds = timpl->unsafe_storage().unsafeGetStorageImpl();
    // The session's index is built only by the ordinary path, which ends the matching prefix.
    if (m->next < m->records.size()) {
      const AliasMemo::Record& r = m->records[m->next];
      AliasCache::Entry* e = r.entry;
      if (r.device == timpl && r.device_storage == ds && e->key == timpl && e->owner == nullptr) {
        ++m->next;
        c10::StorageImpl* cs = e->storage.unsafeGetStorageImpl();
        const c10::TensorImpl* cimpl = e->cpu.unsafeGetTensorImpl();
        if (cs->data() != ds->data() || cs->nbytes() != ds->nbytes() ||
            cimpl->dtype() != timpl->dtype() ||
            ((cimpl->key_set().raw_repr() ^ timpl->key_set().raw_repr()) & kMathBits) != 0 ||
            !same_stored_layout(*cimpl, *timpl)) {
          revalidate(*e, t, ds);
          cs = e->storage.unsafeGetStorageImpl();
        }
        e->owner = s_;
        Session& s = *s_;
        s.storages.push_back({cs, ds});
        s.tensors.emplace_back(at::Tensor(), e, s.hold(t), ds);
        ++s.checked_out;
        return e->cpu;
      }
    }
    m->matching = false;
    m->matched = m->next;
    m->records.resize(m->next);
  }
  return alias_ordinary(t);
}
// [docs:end ALIAS_MEMO_MATCH]

// [docs:start HOST_KERNEL_ALIAS]
C10_NOINLINE const at::Tensor& HostKernel::alias_ordinary(const at::Tensor& t) {
  const c10::TensorImpl* timpl = t.unsafeGetTensorImpl();
  // This thread's cached alias: handed out to this call already (a tensor passed twice), free to
  // be revalidated, or in use by an outer call on this thread (nested kernels).
  AliasCache& cache = *s_->aliases;
  auto it = cache.entries.find(timpl);
  AliasCache::Entry* e = it == cache.entries.end() ? nullptr : it->second;
  // Anything but a cached alias over a storage of its own ends the memo's record of the call.
  if (e != nullptr && e->owner == s_) {
    if (memo_ != nullptr) memo_->recording = false;
    return e->cpu;
  }
  if (s_->uncached != 0) {  // aliased in this call without the cache?
    int found = s_->find_tensor(timpl, Session::DeviceTensor);
    if (found >= 0) {
      if (memo_ != nullptr) memo_->recording = false;
      return s_->tensors[found].cpu();
    }
  }
  const c10::Storage& storage = t.storage();
  c10::StorageImpl* dev_storage = storage.unsafeGetStorageImpl();
  bool claimed;
  int st = s_->claim_device_storage(dev_storage, claimed);
  if (st >= 0) {
    // Another argument of the call has this storage: an alias over the same CPU storage, so that
    // the kernel sees the overlap, made for this call only.
    if (memo_ != nullptr) memo_->recording = false;
    at::Tensor cpu = make_alias(
        c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s_->storages[st].cpu)), t);
    s_->add_tensor(std::move(cpu), t);
    return s_->tensors.back().cpu();
  }
  // The first tensor of its storage in the call: this thread's cached alias, revalidated.
  if (e == nullptr) e = cache.take_over(t);
  if (e == nullptr) {
    if (cache.young.size() >= AliasCache::kYoung) cache.sweep_young();
    if (cache.entries.size() >= cache.sweep_at) cache.sweep();
    e = cache.make(t);
    if (e->cpu.defined()) {
      revalidate(*e, t, dev_storage);  // a swept entry's alias
      g_spare_aliases.fetch_add(1, std::memory_order_relaxed);
    } else {
      e->storage = c10::Storage(c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), dev_storage->nbytes(), borrow(dev_storage),
          c10::GetCPUAllocator(), /*resizable=*/true));
      e->cpu = make_alias(e->storage, t);
    }
    cache.remember(e);
  } else if (e->owner == nullptr) {
    revalidate(*e, t, dev_storage);
  } else {
    // In use by an outer call on this thread (nested kernels): a fresh alias for this call.
    if (memo_ != nullptr) memo_->recording = false;
    c10::Storage cpu_storage(make_cpu_alias_storage(storage));
    s_->add_storage(cpu_storage.unsafeGetStorageImpl(), dev_storage, claimed);  // held by the alias
    at::Tensor cpu = make_alias(std::move(cpu_storage), t);
    s_->add_tensor(std::move(cpu), t);
    return s_->tensors.back().cpu();
  }
  e->owner = s_;
  s_->add_storage(e->storage.unsafeGetStorageImpl(), dev_storage, claimed);
  s_->add_cached_tensor(e, t, dev_storage);
  if (memo_ != nullptr) {
    // The match compares sizes and strides as stored.
    if (plain_tensor_impl(*timpl)) memo_->record(timpl, dev_storage, e);
    else memo_->recording = false;
  }
  return e->cpu;
}
// [docs:end HOST_KERNEL_ALIAS]

void HostKernel::sync_written(const at::Tensor& t) {
  int found = s_->find_tensor(t.unsafeGetTensorImpl(), Session::DeviceTensor);
  if (found < 0) return;
  sync_written(t, s_->tensors[found].cpu());
}

void HostKernel::sync_written(const at::Tensor& t, const at::Tensor& cpu) {
  auto* timpl = t.unsafeGetTensorImpl();
  const c10::TensorImpl* cimpl = cpu.unsafeGetTensorImpl();
  // Both have storages: `cpu` was made over `t`'s, which alias() read through storage().
  auto* cpu_storage = cimpl->unsafe_storage().unsafeGetStorageImpl();
  auto* dev_storage = timpl->unsafe_storage().unsafeGetStorageImpl();
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
  if (!same_layout(*cimpl, *timpl))
    timpl->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
  // Kernels may set the conjugate or negative bit of an out= argument (the bits are metadata of
  // the tensor, not of the memory): the device tensor gets them too.
  if (cpu.is_conj() != t.is_conj()) timpl->_set_conj(cpu.is_conj());
  if (cpu.is_neg() != t.is_neg()) timpl->_set_neg(cpu.is_neg());
}

c10::Storage HostKernel::device_storage_for(const at::Tensor& cpu) {
  const c10::Storage& storage = cpu.storage();
  auto* impl = storage.unsafeGetStorageImpl();
  int found = s_->find_storage(impl, Session::CpuStorage);
  if (found >= 0)  // an argument's, or seen before
    return c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s_->storages[found].device));
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
  s_->add_storage(impl, result.unsafeGetStorageImpl());
  s_->held.push_back(storage);
  s_->held.push_back(result);
  return result;
}

// [docs:start HOST_KERNEL_RESULT]
at::Tensor HostKernel::result(const at::Tensor& cpu) {
  if (!cpu.defined()) return cpu;
  check_profile_dtype(cpu.scalar_type(), device_);  // docs/device_profiles.md
  int found = s_->find_tensor(cpu.unsafeGetTensorImpl(), Session::CpuTensor);
  if (found >= 0) {
    at::Tensor device = s_->tensors[found].device;
    sync_written(device, s_->tensors[found].cpu());
    return device;  // in-place and out= kernels return their argument itself
  }
  return make_device_tensor(device_storage_for(cpu), cpu);
}

// [docs:start RESULT_IN_PLACE]
// A fresh result nobody else holds, in memory the kernel got from the device allocator, becomes
// the device tensor itself: its TensorImpl and StorageImpl change device instead of being
// replaced by new ones (two allocations and two constructions fewer per result).
at::Tensor HostKernel::result(at::Tensor&& cpu) {
  if (!cpu.defined()) return std::move(cpu);
  check_profile_dtype(cpu.scalar_type(), device_);
  c10::TensorImpl* impl = cpu.unsafeGetTensorImpl();
  const c10::Storage& storage = impl->unsafe_storage();
  // A dense CPU tensor, whatever its autograd, autocast and math-bit keys (which follow the
  // backend or stay as they are), and nothing else (no Python, sparse, named, zero-tensor keys).
  static const c10::DispatchKeySet cpu_keys =
      c10::getAutogradRelatedKeySetFromBackend(c10::BackendComponent::CPUBit) |
      c10::getAutocastRelatedKeySetFromBackend(c10::BackendComponent::CPUBit) |
      c10::DispatchKeySet({c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});
  if (cpu.use_count() != 1 || cpu.weak_use_count() != 1 || !storage ||
      storage.use_count() != 1 || !is_device_memory(storage.data_ptr()) ||
      typeid(*impl) != typeid(c10::TensorImpl) ||
      (impl->key_set() - cpu_keys) != c10::DispatchKeySet(c10::DispatchKey::CPU) ||
      impl->autograd_meta() != nullptr || impl->pyobj_slot()->load_pyobj() != nullptr)
    return result(static_cast<const at::Tensor&>(cpu));  // shared, an argument's, or unusual
  c10::Device dev(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_));
  c10::StorageImpl* simpl = storage.unsafeGetStorageImpl();
  simpl->_mutable_data_ptr_no_checks().unsafe_set_device(dev);
  simpl->set_allocator(allocator_for_device(device_));
  impl->set_storage_keep_dtype(storage);  // the tensor's device follows its storage's
  impl->_change_backend_component_keys(dev);
  if (impl->is_wrapped_number()) impl->set_wrapped_number(false);
  return std::move(cpu);
}
// [docs:end RESULT_IN_PLACE]
// [docs:end HOST_KERNEL_RESULT]

// [docs:start KERNEL_THREADS]
namespace {
// This thread's OpenMP and MKL thread counts (not the process's), kept when ATen sets up the
// thread's counts at its first parallel kernel.
void set_kernel_thread_count(int threads) {
  // ATen sets up each thread's counts at the thread's first parallel kernel: to the count of
  // torch.set_num_threads, if it was called, for OpenMP and for MKL. Done first here, so that it
  // does not undo what follows (it did: after torch.set_num_threads(2), the device thread's first
  // kernel of 2 million elements gave it a team of 2).
  (void)at::get_num_threads();
  // This thread's counts only (at::set_num_threads would change the process's), in the OpenMP
  // runtime and the MKL torch is linked with.
  using SetNumThreads = void (*)(int);
  using MklSetNumThreadsLocal = int (*)(int);
  static const auto omp_set =
      reinterpret_cast<SetNumThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  // MKL's C entry point (mkl_service.h maps mkl_set_num_threads_local to it; the lower-case
  // symbol is the Fortran one, which takes a pointer).
  static const auto mkl_set =
      reinterpret_cast<MklSetNumThreadsLocal>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
  if (omp_set != nullptr) omp_set(threads);
  if (mkl_set != nullptr) mkl_set(threads);
}
}  // namespace

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
//
// The count is part of a kernel's result: a reduction or a matmul split over 2 threads rounds
// differently from the same kernel on 1 (docs/determinism.md). So a kernel that runs on another
// thread than the one that issued it runs with the issuing thread's count: a stream's worker
// (asynchronous mode, docs/async_mode.md) runs a kernel queued by the caller with the caller's
// count and one queued by an autograd device thread with one thread; a graph's replay runs each
// kernel with the count of the thread that captured it. A stream's worker starts with one
// thread, for the work it runs that no thread issued as a kernel (copies).
void configure_kernel_thread() {
  thread_local bool configured = false;
  if (configured) return;
  configured = true;
  if (on_stream_worker()) {
    set_kernel_thread_count(1);
    return;
  }
  if (!is_autograd_worker_thread()) return;
  int threads = 1;
  if (const char* env = std::getenv("OPENREG_AUTOGRAD_OMP_THREADS")) threads = std::atoi(env);
  if (threads <= 0) return;
  set_kernel_thread_count(threads);
}

int kernel_thread_count() {
  configure_kernel_thread();
  return at::get_num_threads();  // this thread's OpenMP count (omp_get_max_threads)
}

void use_kernel_thread_count(int threads) {
  thread_local int current = 0;
  if (current == 0) current = kernel_thread_count();
  if (threads == current || threads <= 0) return;
  set_kernel_thread_count(threads);
  current = threads;
}

KernelThreadCount::KernelThreadCount(int threads) {
  const int now = kernel_thread_count();
  if (threads <= 0 || threads == now) return;
  set_kernel_thread_count(threads);
  previous_ = now;
}
KernelThreadCount::~KernelThreadCount() {
  if (previous_ > 0) set_kernel_thread_count(previous_);
}
// [docs:end KERNEL_THREADS]

}  // namespace openreg
