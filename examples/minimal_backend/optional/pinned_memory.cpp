// Native because: torch takes pinned memory only from an at::HostAllocator (C++) and asks the C++
// PrivateUse1 hooks whether an address is pinned.
//
// Optional mechanism of minidev: pinned host memory (docs/host_allocator.md). setup.py builds it
// as its own extension, minidev._pinned_memory; minidev/__init__.py imports it when it is there.
// Without it, pin_memory() raises and the core still passes every required check.
#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <torch/extension.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace {

// [docs:start PINNED_MEMORY]
// "Pinned" memory of a device simulated on the CPU is page-aligned host memory this allocator
// handed out; a real device pins it with its driver (cudaHostAlloc). Not cached: every block goes
// back to the system when its tensor dies (docs/host_allocator.md shows a caching version).
struct PinnedAllocator final : at::HostAllocator {
  std::mutex mutex;
  std::map<uintptr_t, size_t> blocks;  // start -> size of each live block

  at::DataPtr allocate(size_t size) override {
    constexpr size_t kPage = 4096;
    void* ptr = size ? std::aligned_alloc(kPage, (size + kPage - 1) / kPage * kPage) : nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, ptr || !size, "minidev: cannot pin ", size, " bytes");
    if (ptr) {
      std::lock_guard<std::mutex> lock(mutex);
      blocks.emplace(reinterpret_cast<uintptr_t>(ptr), size);
    }
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};  // pinned memory is host memory
  }
  static void release(void* ptr);

  // Is `p` inside a live block (a view at an offset included)? The hooks' isPinnedPtr.
  bool contains(const void* p) {
    const auto address = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mutex);
    auto next = blocks.upper_bound(address);
    return next != blocks.begin() && address < std::prev(next)->first + std::prev(next)->second;
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }
  // minidev's copies complete before they return: no block is in use by a queued copy.
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}  // nothing cached
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
} pinned;

void PinnedAllocator::release(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned.mutex);
    pinned.blocks.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  std::free(ptr);
}

bool is_pinned(const void* p) { return pinned.contains(p); }
// [docs:end PINNED_MEMORY]

}  // namespace

// [docs:start PINNED_REGISTRATION]
// pin_memory() and torch.empty(pin_memory=True) allocate with the hooks' getPinnedMemoryAllocator,
// which returns the host allocator registered for PrivateUse1; is_pinned() asks the hooks'
// isPinnedPtr, which asks this extension's is_pinned (handed over as a capsule: the two
// extensions are separate shared libraries).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  at::setHostAllocator(c10::DeviceType::PrivateUse1, &pinned);
  auto lookup = py::capsule(reinterpret_cast<void*>(&is_pinned), "minidev.is_pinned");
  py::module_::import("minidev._C").attr("set_pinned_lookup")(lookup);
}
// [docs:end PINNED_REGISTRATION]
