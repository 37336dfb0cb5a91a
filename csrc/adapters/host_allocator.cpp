// Native because: PyTorch only accepts the pinned (host) memory allocator as a C++
// at::HostAllocator (at::setHostAllocator / the PrivateUse1 hooks), and its caching machinery
// (at::CachingHostAllocatorImpl) is a C++ template.
//
// "Pinned" memory of a simulated device is page-aligned host memory that the runtime knows about:
// copies between it and a device may be asynchronous (non_blocking=True) because the runtime
// tracks, through record_event, which queued copies still use a block.
#include "adapters/host_allocator.h"

#include "runtime/device.h"
#include "runtime/stream.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>

namespace openreg {
namespace {

using Block = at::HostBlock<c10::Stream>;

// Live pinned blocks by address, for is_pinned() on any pointer inside a block (the caching
// machinery only knows block start addresses).
struct Ranges {
  std::shared_mutex mutex;
  std::map<uintptr_t, size_t> blocks;

  bool contains(const void* ptr) {
    auto addr = reinterpret_cast<uintptr_t>(ptr);
    std::shared_lock lock(mutex);
    auto it = blocks.upper_bound(addr);
    if (it == blocks.begin()) return false;
    --it;
    return addr < it->first + it->second;
  }
};

Ranges& ranges() {
  static auto* r = new Ranges();  // leaked: pinned tensors may be freed during exit
  return *r;
}

// [docs:start HOST_ALLOCATOR_IMPL]
// The caching (free lists per power-of-two size, events per freed block, statistics) is
// PyTorch's; the backend supplies the "driver" calls: get/free pinned memory, record an event
// on a stream and query it.
struct OpenRegHostAllocatorImpl final
    : public at::CachingHostAllocatorImpl<c10::Stream, EventPtr> {
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  void allocate_host_memory(size_t size, void** ptr) override {
    lazy_init();  // like cudaHostAlloc, pinning memory initialises the runtime
    auto start = std::chrono::steady_clock::now();
    constexpr size_t kPage = 4096;
    void* p = std::aligned_alloc(kPage, (size + kPage - 1) / kPage * kPage);
    TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "openreg: cannot allocate ", size,
                     " bytes of pinned host memory");
    {
      std::unique_lock lock(ranges().mutex);
      ranges().blocks.emplace(reinterpret_cast<uintptr_t>(p), size);
    }
    *ptr = p;
    record_time(stats_.host_alloc_time, start);
  }

  void free_block(Block* block) override {
    auto start = std::chrono::steady_clock::now();
    {
      std::unique_lock lock(ranges().mutex);
      ranges().blocks.erase(reinterpret_cast<uintptr_t>(block->ptr_));
    }
    std::free(block->ptr_);
    record_time(stats_.host_free_time, start);
  }

  // Called when a block recorded on `stream` is freed: an event behind the work queued there.
  void record_stream(std::optional<std::vector<EventPtr>>& events, c10::Stream stream) override {
    auto event = event_create(stream.device_index(), /*enable_timing=*/false);
    event_record(event, get_stream(stream.device_index(), stream.id()));
    events->push_back(std::move(event));
  }

  bool query_event(EventPtr& event) override { return event_query(event); }

  c10::Stream get_current_stream() const override {
    int device = current_device();
    return c10::Stream(c10::Stream::UNSAFE,
                       c10::Device(c10::DeviceType::PrivateUse1, c10::DeviceIndex(device)),
                       current_stream_id(device));
  }

  bool stream_is_capturing(c10::Stream) const override { return false; }  // no graph capture

  void record_time(at::DurationStat& stat, std::chrono::steady_clock::time_point start) {
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                  std::chrono::steady_clock::now() - start).count();
    std::lock_guard lock(stats_.timing_mutex_);
    stat.increase(us);
  }
};

DECLARE_HOST_ALLOCATOR(OpenRegHostAllocator, OpenRegHostAllocatorImpl, delete_pinned,
                       g_host_allocator)

struct Registration {
  Registration() { at::setHostAllocator(c10::DeviceType::PrivateUse1, &g_host_allocator); }
} g_registration;
// [docs:end HOST_ALLOCATOR_IMPL]

}  // namespace

at::HostAllocator* host_allocator() { return &g_host_allocator; }

bool is_pinned_pointer(const void* ptr) { return ptr != nullptr && ranges().contains(ptr); }

bool record_host_use(const at::Tensor& host, c10::Stream stream) {
  const auto& data = host.storage().data_ptr();
  if (data.get_deleter() != &delete_pinned) return false;
  return g_host_allocator.record_event(data.get(), data.get_context(), stream);
}

}  // namespace openreg
