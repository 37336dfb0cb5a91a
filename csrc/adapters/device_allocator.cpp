// Native because: PyTorch only accepts a device allocator as a C++ c10::DeviceAllocator, and
// allocation is on the per-operator hot path.
//
// A caching allocator in the style of CUDA's: device memory is obtained from the simulated
// driver in segments (runtime/memory.cpp), split into blocks, and freed blocks are cached per
// stream for reuse. A block used on another stream (record_stream) is only reused after the work
// queued on that stream at free time has run. Exceeding the device capacity, after releasing the
// cache, raises torch.OutOfMemoryError.
#include "adapters/autograd.h"
#include "adapters/device_allocator.h"
#include "adapters/gpu_trace.h"

#include "adapters/ipc.h"

#include "runtime/device.h"
#include "runtime/faults.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <vector>

namespace openreg {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::StatType;

constexpr size_t kMinBlockSize = 512;           // all sizes are rounded to this
constexpr size_t kSmallSize = 1 << 20;          // requests up to 1 MiB come from the small pool
constexpr size_t kSmallBuffer = 2 << 20;        // segment size of the small pool
constexpr size_t kLargeBuffer = 20 << 20;       // segment size for requests of 1-10 MiB
constexpr size_t kMinLargeAlloc = 10 << 20;     // above this, segments are sized to the request
constexpr size_t kRoundLarge = 2 << 20;         // ... rounded to 2 MiB

struct Block {
  int device;
  int64_t stream;
  size_t size;
  size_t requested = 0;
  char* ptr;
  bool small;
  bool allocated = false;
  Block* prev = nullptr;  // neighbours inside the same segment
  Block* next = nullptr;
  std::vector<int64_t> stream_uses;  // other streams the block was used on (record_stream)
  int pending_events = 0;
  bool hot = false;  // freed, waiting unmerged in a size's LIFO list (HOT_BLOCKS)
};

struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};

std::string format_size(size_t bytes) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(2);
  if (bytes < (1 << 10)) os << bytes << " bytes";
  else if (bytes < (1 << 20)) os << bytes / 1024.0 << " KiB";
  else if (bytes < (size_t(1) << 30)) os << bytes / 1048576.0 << " MiB";
  else os << bytes / 1073741824.0 << " GiB";
  return os.str();
}

// Each allocation and free updates about ten statistics (aggregate and pool); inlined and with
// the two entries written directly, they were 318 instructions of a 4-element add out of line.
inline __attribute__((always_inline)) void update(
    DeviceStats& s, c10::CachingAllocator::StatArray DeviceStats::*field, bool small,
    int64_t amount) {
  auto& arr = s.*field;
  auto& all = arr[size_t(StatType::AGGREGATE)];
  auto& pool = arr[size_t(small ? StatType::SMALL_POOL : StatType::LARGE_POOL)];
  if (amount >= 0) {
    all.increase(amount);
    pool.increase(amount);
  } else {
    all.decrease(-amount);
    pool.decrease(-amount);
  }
}

class DeviceCache {
 public:
  explicit DeviceCache(int device) : device_(device), limit_(device_capacity()) {}

  Block* malloc(size_t requested, int64_t stream) {
    std::unique_lock lock(mutex_);
    process_outstanding();
    size_t size = round_size(requested);
    bool small = size <= kSmallSize;
    auto& pool = small ? small_free_ : large_free_;
    // [docs:start MALLOC_RETRY]
    // An injected out-of-memory error (runtime/faults.h, docs/fault_injection.md) takes the
    // path of a real one: no cached block, no new segment, before and after the retry.
    const bool injected = inject_oom(device_, requested);
    Block* block = injected ? nullptr : take_hot(size, stream);
    if (block == nullptr && !injected) {
      block = take_free(pool, size, stream);
      // None in the pools: the hot blocks, merged back, may make one (before a new segment)
      if (block == nullptr && hot_count_ > 0) {
        flush_hot();
        block = take_free(pool, size, stream);
      }
    }
    if (block == nullptr) {
      size_t segment_size = segment_size_for(size);
      char* mem = injected ? nullptr : reserve(segment_size);
      if (mem == nullptr) {
        // Like CUDA: release every cached segment and try once more before failing, after
        // freeing the storages other processes have stopped using (IPC, adapters/ipc.cpp).
        stats_.num_alloc_retries++;
        lock.unlock();
        ipc_collect();  // frees blocks: must not hold the mutex
        wait_for_queued_kernels(device_);  // they may use cached blocks (async mode, stream.h)
        lock.lock();
        wait_outstanding(lock);
        release_cached();
        mem = injected ? nullptr : reserve(segment_size);
      }
      if (mem == nullptr) {
        stats_.num_ooms++;
        raise_oom(requested, injected);
      }
      block = new_block(stream, segment_size, mem, small);
      update(stats_, &DeviceStats::segment, small, 1);
      update(stats_, &DeviceStats::reserved_bytes, small, segment_size);
      stats_.num_device_alloc++;
    }
    // [docs:end MALLOC_RETRY]
    // Split off the tail if worth keeping.
    size_t remaining = block->size - size;
    if ((small && remaining >= kMinBlockSize) || (!small && remaining > kSmallSize)) {
      Block* rest = new_block(stream, remaining, block->ptr + size, small);
      rest->prev = block;
      rest->next = block->next;
      if (rest->next) rest->next->prev = rest;
      block->next = rest;
      block->size = size;
      pool_insert(pool, rest);
    }
    block->allocated = true;
    block->requested = requested;
    live_.emplace(block->ptr, block);
    update(stats_, &DeviceStats::allocation, small, 1);
    update(stats_, &DeviceStats::active, small, 1);
    update(stats_, &DeviceStats::allocated_bytes, small, block->size);
    update(stats_, &DeviceStats::active_bytes, small, block->size);
    update(stats_, &DeviceStats::requested_bytes, small, requested);
    report_to_profiler(block->ptr, int64_t(block->size));
    return block;
  }

  // [docs:start PROFILE_MEMORY]
  // torch.profiler's profile_memory=True: every allocation and free of a block, with the device's
  // allocated and reserved totals after it (docs/profiler.md).
  void report_to_profiler(void* ptr, int64_t delta) {
    if (!c10::memoryProfilingEnabled()) return;
    c10::reportMemoryUsageToProfiler(
        ptr, delta, size_t(stats_.allocated_bytes[size_t(StatType::AGGREGATE)].current),
        size_t(stats_.reserved_bytes[size_t(StatType::AGGREGATE)].current),
        c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_)));
  }
  // [docs:end PROFILE_MEMORY]

  bool free(void* ptr) {
    std::lock_guard lock(mutex_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return false;
    Block* block = it->second;
    live_.erase(it);
    block->allocated = false;
    update(stats_, &DeviceStats::allocation, block->small, -1);
    update(stats_, &DeviceStats::allocated_bytes, block->small, -int64_t(block->size));
    update(stats_, &DeviceStats::requested_bytes, block->small, -int64_t(block->requested));
    report_to_profiler(block->ptr, -int64_t(block->size));
    // [docs:start FREE_RECORD_STREAM]
    if (!block->stream_uses.empty()) {
      // The block may still be read or written by work queued on those streams: reuse it
      // only once that work has run.
      for (int64_t s : block->stream_uses) {
        auto event = event_create(device_, false);
        event_record(event, get_stream(device_, s));
        outstanding_.emplace_back(std::move(event), block);
        block->pending_events++;
      }
      block->stream_uses.clear();
    } else if (!keep_hot(block)) {
      release_block(block);
    }
    // [docs:end FREE_RECORD_STREAM]
    return true;
  }

  // The stream (pool key) and size of a live block, for the sanitizer.
  bool block_info(const void* ptr, int64_t* stream, size_t* size) {
    std::lock_guard lock(mutex_);
    auto it = live_.find(const_cast<void*>(ptr));
    if (it == live_.end()) return false;
    *stream = it->second->stream;
    *size = it->second->requested;
    return true;
  }

  void record_stream(void* ptr, int64_t stream) {
    std::lock_guard lock(mutex_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return;
    Block* block = it->second;
    if (stream == block->stream || block->stream >= kPoolKeyBase) return;  // graph pools are stream-ordered by their graph
    if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
        block->stream_uses.end())
      block->stream_uses.push_back(stream);
  }

  // ---- private pools (keys above kPoolKeyBase; stream ids are below)
  static constexpr int64_t kPoolKeyBase = int64_t(1) << 40;

  int64_t pool_acquire(c10::MempoolId_t id) {
    std::lock_guard lock(mutex_);
    auto it = pools_.find(id);
    if (it == pools_.end()) it = pools_.emplace(id, std::pair<int64_t, int>{next_pool_key_++, 0}).first;
    it->second.second++;
    return it->second.first;
  }

  void pool_release(c10::MempoolId_t id) {
    std::lock_guard lock(mutex_);
    auto it = pools_.find(id);
    if (it == pools_.end() || --it->second.second > 0) return;
    const int64_t key = it->second.first;
    pools_.erase(it);
    dead_pools_.insert(key);
    for (auto* pool : {&small_free_, &large_free_})
      for (auto b = pool->begin(); b != pool->end();) {
        Block* block = *b;
        if (block->stream != key || block->prev || block->next) { ++b; continue; }
        b = pool_erase(*pool, b);
        free_segment(block);
      }
  }

  bool in_private_pool(const void* ptr) {
    std::lock_guard lock(mutex_);
    auto it = live_.find(const_cast<void*>(ptr));
    return it != live_.end() && it->second->stream >= kPoolKeyBase;
  }

  bool owns(const void* ptr) {
    std::lock_guard lock(mutex_);
    return live_.count(const_cast<void*>(ptr)) != 0;
  }

  void empty_cache() {
    // Cached blocks may still be used by queued asynchronous kernels (stream.h): segments go
    // back to the driver only after those ran, as cudaFree synchronizes the device.
    wait_for_queued_kernels(device_);
    std::unique_lock lock(mutex_);
    wait_outstanding(lock);
    release_cached();
  }

  DeviceStats stats() {
    std::lock_guard lock(mutex_);
    refresh_inactive_split();
    return stats_;
  }

  void reset_peak() {
    std::lock_guard lock(mutex_);
    for (auto* arr : all_stat_arrays())
      for (auto& s : *arr) s.reset_peak();
    stats_.oversize_allocations.reset_peak();
    stats_.oversize_segments.reset_peak();
  }

  void reset_accumulated() {
    std::lock_guard lock(mutex_);
    for (auto* arr : all_stat_arrays())
      for (auto& s : *arr) s.reset_accumulated();
    stats_.num_alloc_retries = 0;
    stats_.num_ooms = 0;
    stats_.num_device_alloc = 0;
    stats_.num_device_free = 0;
  }

  void set_fraction(double fraction) {
    TORCH_CHECK_VALUE(fraction >= 0 && fraction <= 1,
                      "invalid fraction ", fraction, ", it must be in [0, 1]");
    std::lock_guard lock(mutex_);
    limit_ = static_cast<size_t>(fraction * device_capacity());
  }

 private:
  std::vector<c10::CachingAllocator::StatArray*> all_stat_arrays() {
    return {&stats_.allocation, &stats_.segment, &stats_.active, &stats_.inactive_split,
            &stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes,
            &stats_.inactive_split_bytes, &stats_.requested_bytes};
  }

  static size_t round_size(size_t size) {
    if (size < kMinBlockSize) return kMinBlockSize;
    return (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
  }

  static size_t segment_size_for(size_t size) {
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return kLargeBuffer;
    return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
  }

  char* reserve(size_t segment_size) {
    size_t reserved = size_t(stats_.reserved_bytes[size_t(StatType::AGGREGATE)].current);
    if (reserved + segment_size > limit_) return nullptr;
    return static_cast<char*>(segment_alloc(device_, segment_size));
  }

  Block* take_free(std::set<Block*, BlockOrder>& pool, size_t size, int64_t stream) {
    Block key{device_, stream, size, 0, nullptr, false};
    auto it = pool.lower_bound(&key);
    if (it == pool.end() || (*it)->stream != stream) return nullptr;
    Block* block = *it;
    // Any cached block at least as large serves the request (it is split below), as in CUDA's
    // allocator with its default settings. (Refusing blocks of 10 MiB and more for smaller
    // requests made every 1-10 MiB request reserve a new 20 MiB segment once the free pieces of
    // a segment had merged back: the CNN benchmark reserved 2.4 GB in 13 steps.)
    pool_erase(pool, it);
    return block;
  }

  bool live_pool(int64_t key) const {
    return key >= kPoolKeyBase && dead_pools_.count(key) == 0;
  }

  void free_segment(Block* b) {
    segment_free(b->ptr);
    update(stats_, &DeviceStats::segment, b->small, -1);
    update(stats_, &DeviceStats::reserved_bytes, b->small, -int64_t(b->size));
    stats_.num_device_free++;
    delete_block(b);
  }

  // Returns a freed block to its pool, merging it with free neighbours.
  void release_block(Block* block) {
    update(stats_, &DeviceStats::active, block->small, -1);
    update(stats_, &DeviceStats::active_bytes, block->small, -int64_t(block->size));
    merge_into_pool(block);
  }

  void merge_into_pool(Block* block) {
    auto& pool = block->small ? small_free_ : large_free_;
    for (Block* neighbour : {block->prev, block->next}) {
      if (!neighbour || neighbour->allocated || neighbour->pending_events > 0 || neighbour->hot)
        continue;
      pool_erase(pool, pool.find(neighbour));
      if (neighbour == block->prev) {
        block->ptr = neighbour->ptr;
        block->prev = neighbour->prev;
        if (block->prev) block->prev->next = block;
      } else {
        block->next = neighbour->next;
        if (block->next) block->next->prev = block;
      }
      block->size += neighbour->size;
      delete_block(neighbour);
    }
    // The last piece of a released graph pool's segment: back to the driver.
    if (block->stream >= kPoolKeyBase && !live_pool(block->stream) && !block->prev &&
        !block->next) {
      free_segment(block);
      return;
    }
    pool_insert(pool, block);
  }

  // Free blocks that are pieces of a split segment (they cannot go back to the driver):
  // counted when statistics are read rather than on every allocation.
  void refresh_inactive_split() {
    for (bool small : {true, false}) {
      int64_t count = 0, bytes = 0;
      for (Block* b : small ? small_free_ : large_free_)
        if (b->prev || b->next) ++count, bytes += int64_t(b->size);
      if (small)
        for (const auto& list : hot_)
          for (Block* b : list)
            if (b->prev || b->next) ++count, bytes += int64_t(b->size);
      for (auto [field, value] : {std::pair{&DeviceStats::inactive_split, count},
                                  std::pair{&DeviceStats::inactive_split_bytes, bytes}}) {
        auto& stat = (stats_.*field)[size_t(small ? StatType::SMALL_POOL : StatType::LARGE_POOL)];
        update(stats_, field, small, value - stat.current);
      }
    }
  }

  void process_outstanding() {
    while (!outstanding_.empty()) {
      auto& [event, block] = outstanding_.front();
      if (!event_query(event)) break;
      Block* b = block;
      outstanding_.pop_front();
      if (--b->pending_events == 0) release_block(b);
    }
  }

  // Waits with the mutex released: the stream work these events wait for may itself need the
  // allocator (a stream worker frees the tensors of a finished task), so waiting while holding
  // the mutex could deadlock.
  void wait_outstanding(std::unique_lock<std::mutex>& lock) {
    if (outstanding_.empty()) return;
    std::vector<EventPtr> events;
    for (auto& entry : outstanding_) events.push_back(entry.first);
    lock.unlock();
    for (auto& event : events) event_synchronize(event);
    lock.lock();
    process_outstanding();
  }

  // Gives every free, unsplit segment back to the driver.
  void release_cached() {
    flush_hot();
    for (auto* pool : {&small_free_, &large_free_}) {
      for (auto it = pool->begin(); it != pool->end();) {
        Block* b = *it;
        // Free blocks of a live graph pool stay: the graph replays into them.
        if (b->prev || b->next || live_pool(b->stream)) {
          ++it;
          continue;
        }
        it = pool_erase(*pool, it);
        free_segment(b);
      }
    }
  }

  // [docs:start RAISE_OOM]
  [[noreturn]] void raise_oom(size_t requested, bool injected) {
    size_t capacity = device_capacity();
    size_t used = driver_used(device_);
    size_t allocated = size_t(stats_.allocated_bytes[0].current);
    size_t reserved = size_t(stats_.reserved_bytes[0].current);
    std::ostringstream msg;
    msg << "OpenReg out of memory. Tried to allocate " << format_size(requested) << ". Device "
        << device_ << " has a total capacity of " << format_size(capacity) << " of which "
        << format_size(capacity > used ? capacity - used : 0) << " is free.";
    if (limit_ < capacity)
      msg << " This process is limited to " << format_size(limit_)
          << " by set_per_process_memory_fraction.";
    msg << " Of the allocated memory " << format_size(allocated)
        << " is allocated by PyTorch, and " << format_size(reserved - allocated)
        << " is reserved by PyTorch but unallocated. The capacity of each simulated device is "
           "set by OPENREG_DEVICE_MEMORY (for example OPENREG_DEVICE_MEMORY=16GB).";
    if (injected)
      msg << " (This out-of-memory error was injected by torch.openreg.faults.oom or "
             "OPENREG_FAULTS; docs/fault_injection.md.)";
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg.str());
  }
  // [docs:end RAISE_OOM]

  // [docs:start SPARE_NODES]
  // A tiny tensor's allocation and free split a cached block and merge it back: two Block
  // objects and two nodes of the free pools' trees made and destroyed each time, six calls of
  // malloc and free per tensor (a visible share of a loop of tiny operators, docs/fallback.md).
  // The blocks and tree nodes are kept for reuse instead (the trees' own nodes, taken out with
  // extract() and put back with insert()), up to kSpare of each.
  using Pool = std::set<Block*, BlockOrder>;
  static constexpr size_t kSpare = 256;
  Block* new_block(int64_t stream, size_t size, char* ptr, bool small) {
    if (spare_blocks_.empty()) return new Block{device_, stream, size, 0, ptr, small};
    Block* b = spare_blocks_.back();
    spare_blocks_.pop_back();
    *b = Block{device_, stream, size, 0, ptr, small};
    return b;
  }
  void delete_block(Block* b) {
    if (spare_blocks_.size() < kSpare) spare_blocks_.push_back(b);
    else delete b;
  }
  void pool_insert(Pool& pool, Block* b) {
    if (spare_nodes_.empty()) {
      pool.insert(b);
      return;
    }
    Pool::node_type node = std::move(spare_nodes_.back());
    spare_nodes_.pop_back();
    node.value() = b;
    pool.insert(std::move(node));
  }
  Pool::iterator pool_erase(Pool& pool, Pool::iterator it) {
    auto next = std::next(it);
    Pool::node_type node = pool.extract(it);
    if (spare_nodes_.size() < kSpare) spare_nodes_.push_back(std::move(node));
    return next;
  }
  // [docs:end SPARE_NODES]

  // [docs:start HOT_BLOCKS]
  // Even with SPARE_NODES, a tiny tensor's free merged its block back into the cached one it was
  // split from and its next allocation split it off again: four searches and rebalancings of
  // the free pools' trees per tensor (about 500 instructions, and cache misses on the trees'
  // nodes, of a sparse operator's 10 allocations through the layout fallback, issue 41). A
  // freed block of at most kHotMax bytes (no other stream's work pending on it, not in a
  // graph's pool) waits unmerged instead, in a last-in-first-out list of its size, for the next
  // request of that size on its stream, as the CPU's malloc keeps small chunks in per-size bins.
  // It counts as free (active and inactive_split, as a free piece of a split segment) and no
  // neighbour merges with it. The lists are merged back into the pools (flush_hot) before a new
  // segment is reserved and whenever cached memory goes back to the driver (empty_cache, the
  // retry before out of memory), so they never make the device reserve more than before.
  static constexpr size_t kHotMax = 8 << 10;
  static constexpr size_t kHotDepth = 32;  // blocks per size
  static size_t hot_class(size_t size) { return size / kMinBlockSize - 1; }

  Block* take_hot(size_t size, int64_t stream) {
    if (size > kHotMax) return nullptr;
    auto& list = hot_[hot_class(size)];
    if (list.empty() || list.back()->stream != stream) return nullptr;
    Block* block = list.back();
    list.pop_back();
    block->hot = false;
    --hot_count_;
    return block;
  }

  bool keep_hot(Block* block) {
    if (!block->small || block->size > kHotMax || block->stream >= kPoolKeyBase) return false;
    auto& list = hot_[hot_class(block->size)];
    if (list.size() >= kHotDepth) return false;
    update(stats_, &DeviceStats::active, true, -1);
    update(stats_, &DeviceStats::active_bytes, true, -int64_t(block->size));
    block->hot = true;
    list.push_back(block);
    ++hot_count_;
    return true;
  }

  void flush_hot() {
    if (hot_count_ == 0) return;
    for (auto& list : hot_) {
      for (Block* b : list) {
        b->hot = false;  // one at a time: a hot neighbour merges when its own turn comes
        merge_into_pool(b);
      }
      list.clear();
    }
    hot_count_ = 0;
  }
  // [docs:end HOT_BLOCKS]

  const int device_;
  size_t limit_;
  std::mutex mutex_;
  Pool small_free_, large_free_;
  std::vector<Block*> spare_blocks_;
  std::vector<Pool::node_type> spare_nodes_;
  std::array<std::vector<Block*>, kHotMax / kMinBlockSize> hot_;
  size_t hot_count_ = 0;
  ska::flat_hash_map<void*, Block*> live_;  // open addressing: no node allocated per block
  std::deque<std::pair<EventPtr, Block*>> outstanding_;
  DeviceStats stats_;
  std::map<c10::MempoolId_t, std::pair<int64_t, int>> pools_;  // id -> (key, graphs using it)
  std::set<int64_t> dead_pools_;
  int64_t next_pool_key_ = kPoolKeyBase;
};

std::vector<std::unique_ptr<DeviceCache>>& caches() {
  static auto* c = [] {
    auto* v = new std::vector<std::unique_ptr<DeviceCache>>();  // leaked: used until exit
    for (int d = 0; d < device_count(); ++d) v->push_back(std::make_unique<DeviceCache>(d));
    return v;
  }();
  return *c;
}

DeviceCache& cache(int device) {
  check_device(device);
  return *caches()[device];
}

void delete_device_memory(void* ptr) {
  release_pin_if_caller();
  gpu_trace::memory_deallocation(ptr);  // outside the cache's mutex: the hook may take the GIL
  for (auto& c : caches())
    if (c->free(ptr)) return;
  TORCH_INTERNAL_ASSERT(false, "openreg: freeing memory the device allocator does not own");
}

// [docs:start ALLOCATOR_COPY_DATA]
// Allocator::copy_data: torch copies device memory with it when a copy-on-write storage is
// materialized (ops/cow.h), at any point of an operator (ATen's TensorIterator asks for its
// output's memory before the kernel launches). The copy comes after the work issued on the
// device's current stream, as a kernel would: in the asynchronous mode a write to the shared
// memory may still be queued. (Inside a kernel the stream is already in order.)
void copy_in_stream_order(int device, void* dest, const void* src, std::size_t count) {
  if (!inside_stream_work()) stream_wait(current_stream(device));
  KernelScope scope;
  std::memcpy(dest, src, count);
}
// [docs:end ALLOCATOR_COPY_DATA]

class OpenRegDeviceAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override { return allocate_on_device(current_device(), nbytes); }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_device_memory; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    copy_in_stream_order(current_device(), dest, src, count);
  }
  bool initialized() override { return is_initialized(); }
  void emptyCache(c10::MempoolId_t) override {
    for (auto& c : caches()) c->empty_cache();
  }
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    // By address: a storage adopted from a kernel result keeps the block's start address.
    if (ptr.get() == nullptr) return;
    cache(stream.device_index()).record_stream(ptr.get(), stream.id());
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override { return cache(device).stats(); }
  void resetAccumulatedStats(c10::DeviceIndex device) override { cache(device).reset_accumulated(); }
  void resetPeakStats(c10::DeviceIndex device) override { cache(device).reset_peak(); }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device(device);
    size_t capacity = device_capacity();
    size_t used = driver_used(device);
    return {capacity > used ? capacity - used : 0, capacity};
  }
};

OpenRegDeviceAllocator g_device_allocator;

class DeviceBoundAllocator final : public c10::Allocator {
 public:
  explicit DeviceBoundAllocator(int device) : device_(device) {}
  c10::DataPtr allocate(size_t nbytes) override { return allocate_on_device(device_, nbytes); }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_device_memory; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    copy_in_stream_order(device_, dest, src, count);
  }

 private:
  int device_;
};

// ---------------------------------------------------------------- host redirection

thread_local int tls_allocate_on = -1;

c10::Allocator* default_cpu_allocator() {
  static c10::Allocator* a = c10::GetDefaultCPUAllocator();
  return a;
}

void redirect_raw_delete(void* ptr) {
  if (device_of_pointer(ptr) >= 0) delete_device_memory(ptr);
  else default_cpu_allocator()->raw_deleter()(ptr);
}

// Installed as the CPU allocator. Outside the generic fallback it forwards to the default CPU
// allocator; inside, it hands out device memory (marked as CPU for the CPU kernel).
class CpuRedirectAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (tls_allocate_on < 0) return default_cpu_allocator()->allocate(nbytes);
    c10::DataPtr ptr = allocate_on_device(tls_allocate_on, nbytes);
    ptr.unsafe_set_device(c10::Device(c10::DeviceType::CPU));
    return ptr;
  }
  c10::DeleterFnPtr raw_deleter() const override { return &redirect_raw_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    KernelScope scope;
    std::memcpy(dest, src, count);
  }
};

CpuRedirectAllocator g_cpu_redirect;

// [docs:start DEVICE_ALLOCATOR_REGISTRATION]
struct Registration {
  Registration() {
    c10::SetAllocator(c10::DeviceType::PrivateUse1, &g_device_allocator);
    default_cpu_allocator();
    c10::SetCPUAllocator(&g_cpu_redirect, /*priority=*/1);
  }
} g_registration;
// [docs:end DEVICE_ALLOCATOR_REGISTRATION]

}  // namespace

c10::DeviceAllocator* device_allocator() { return &g_device_allocator; }

c10::Allocator* allocator_for_device(int device) {
  static auto* bound = [] {
    auto* v = new std::vector<std::unique_ptr<DeviceBoundAllocator>>();  // leaked on purpose
    for (int d = 0; d < device_count(); ++d) v->push_back(std::make_unique<DeviceBoundAllocator>(d));
    return v;
  }();
  check_device(device);
  return (*bound)[device].get();
}

c10::DataPtr allocate_on_device(int device, size_t nbytes) {
  check_device(device);
  check_not_forked();
  c10::Device dev(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  if (nbytes == 0) return c10::DataPtr(nullptr, dev);
  // [docs:start POOL_ROUTING]
  // Allocations on a stream that captures a graph come from the graph's private pool.
  Capture* capture = g_active_captures.load(std::memory_order_relaxed) > 0
                         ? stream_capture(current_stream(device))
                         : nullptr;
  const int64_t key = capture != nullptr ? capture->pool_key : current_stream_id(device);
  Block* block = cache(device).malloc(nbytes, key);
  // [docs:end POOL_ROUTING]
  gpu_trace::memory_allocation(block->ptr);
  return c10::DataPtr(block->ptr, block->ptr, &delete_device_memory, dev);
}

bool is_device_memory(const c10::DataPtr& ptr) {
  return ptr.get_deleter() == &delete_device_memory;
}

bool device_block_info(const void* ptr, int* device, int64_t* stream, size_t* size) {
  for (int d = 0; d < int(caches().size()); ++d)
    if (caches()[d]->block_info(ptr, stream, size)) {
      *device = d;
      return true;
    }
  return false;
}

void set_memory_fraction(double fraction, int device) { cache(device).set_fraction(fraction); }

int64_t pool_acquire(int device, c10::MempoolId_t id) { return cache(device).pool_acquire(id); }
void pool_release(int device, c10::MempoolId_t id) { cache(device).pool_release(id); }
bool in_private_pool(int device, const void* ptr) { return cache(device).in_private_pool(ptr); }

AllocateOnDevice::AllocateOnDevice(int device) : previous_(tls_allocate_on) {
  tls_allocate_on = device;
}
AllocateOnDevice::~AllocateOnDevice() { tls_allocate_on = previous_; }

}  // namespace openreg
