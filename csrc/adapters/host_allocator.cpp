// Native because: PyTorch only accepts the pinned (host) memory allocator as a C++
// at::HostAllocator (at::setHostAllocator / the PrivateUse1 hooks).
#include "adapters/host_allocator.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace openreg {
namespace {

// Pinned memory is ordinary host memory that the runtime knows about: copies between it and the
// device may run asynchronously (non_blocking=True) because the runtime can keep it alive.
class OpenRegHostAllocator final : public at::HostAllocator {
 public:
  at::DataPtr allocate(size_t size) override {
    if (size == 0) return at::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
    void* ptr = std::aligned_alloc(64, (size + 63) / 64 * 64);
    TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "openreg: cannot allocate ", size,
                     " bytes of pinned host memory");
    std::lock_guard lock(mutex_);
    blocks_.emplace(reinterpret_cast<uintptr_t>(ptr), size);
    stats_.active_requests.increase(1);
    stats_.active_bytes.increase(size);
    stats_.allocations.increase(1);
    stats_.allocated_bytes.increase(size);
    stats_.num_host_alloc++;
    return at::DataPtr(ptr, ptr, &OpenRegHostAllocator::deleter, c10::Device(c10::DeviceType::CPU));
  }

  static void deleter(void* ptr);

  void free(void* ptr) {
    std::lock_guard lock(mutex_);
    auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
    TORCH_INTERNAL_ASSERT(it != blocks_.end());
    stats_.active_requests.decrease(1);
    stats_.active_bytes.decrease(it->second);
    stats_.allocations.decrease(1);
    stats_.allocated_bytes.decrease(it->second);
    stats_.num_host_free++;
    blocks_.erase(it);
    std::free(ptr);
  }

  bool contains(const void* ptr) {
    auto addr = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard lock(mutex_);
    auto it = blocks_.upper_bound(addr);
    if (it == blocks_.begin()) return false;
    --it;
    return addr < it->first + it->second;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &OpenRegHostAllocator::deleter; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  void reset_accumulated_stats() override {
    std::lock_guard lock(mutex_);
    for (auto* s : {&stats_.active_requests, &stats_.active_bytes, &stats_.allocations,
                    &stats_.allocated_bytes})
      s->reset_accumulated();
    stats_.num_host_alloc = stats_.num_host_free = 0;
  }
  void reset_peak_stats() override {
    std::lock_guard lock(mutex_);
    for (auto* s : {&stats_.active_requests, &stats_.active_bytes, &stats_.allocations,
                    &stats_.allocated_bytes})
      s->reset_peak();
  }

 private:
  std::mutex mutex_;
  std::map<uintptr_t, size_t> blocks_;
  at::HostStats stats_;
};

OpenRegHostAllocator g_host_allocator;

void OpenRegHostAllocator::deleter(void* ptr) { g_host_allocator.free(ptr); }

struct Registration {
  Registration() { at::setHostAllocator(c10::DeviceType::PrivateUse1, &g_host_allocator); }
} g_registration;

}  // namespace

at::HostAllocator* host_allocator() { return &g_host_allocator; }
bool is_pinned_pointer(const void* ptr) { return ptr != nullptr && g_host_allocator.contains(ptr); }

}  // namespace openreg
