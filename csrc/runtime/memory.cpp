// Native because: the simulated device driver owns device memory; segments are mmap'd so that
// strict isolation can revoke host access with mprotect, and backed by shared-memory files so that
// other processes can map them (IPC), which only native code can do.
#include "runtime/memory.h"

#include "runtime/device.h"

#include <c10/util/Exception.h>

#include <signal.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <vector>

namespace openreg {
namespace {

struct Segment {
  size_t size;
  int device;
  int fd;         // shared-memory file backing the segment (-1: anonymous memory)
  bool imported;  // mapped from another process's segment: not counted in `used`
};

struct Registry {
  std::shared_mutex mutex;
  std::map<uintptr_t, Segment> segments;  // base address -> segment
  std::vector<size_t> used = std::vector<size_t>(64, 0);
};

Registry& registry() {
  static auto* r = new Registry();  // leaked: worker threads may still run at exit
  return *r;
}

// Strict mode state: number of live KernelScopes and the lock serialising protection changes.
std::mutex g_protect_mutex;
int g_scopes = 0;
std::atomic<uintptr_t> g_low{UINTPTR_MAX}, g_high{0};
struct sigaction g_previous_segv;

void protect_all(int prot) {
  for (auto& [base, seg] : registry().segments)
    mprotect(reinterpret_cast<void*>(base), seg.size, prot);
}

// [docs:start SEGV_HANDLER]
void on_segv(int sig, siginfo_t* info, void* ctx) {
  auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (addr >= g_low.load() && addr < g_high.load()) {
    char msg[256];
    int n = snprintf(msg, sizeof msg,
                     "\nopenreg: host code accessed device memory at %p outside of a kernel or a "
                     "copy (OPENREG_STRICT_MEMORY=1). Device memory is not host-accessible: use "
                     "tensor.cpu() or an openreg operator.\n",
                     info->si_addr);
    if (n > 0) {
      ssize_t ignored = write(STDERR_FILENO, msg, static_cast<size_t>(n));
      (void)ignored;
    }
  }
  // Hand the fault to whoever was installed before (Python's faulthandler, or the default
  // action); returning re-executes the faulting access under that handler.
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
}
// [docs:end SEGV_HANDLER]

void install_segv_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = &on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
  });
}

// Descriptors held by segments' shared-memory files (SEGMENT_FILE below).
std::atomic<int> g_segment_files{0};

// [docs:start SEGMENT_MMAP]
// Maps a segment (from its shared-memory file, or anonymous memory when fd < 0) and registers
// it. In strict mode it starts host-inaccessible unless a kernel is running.
void* map_segment(int device, size_t size, int fd, bool imported) {
  const bool strict = strict_memory();
  if (strict) install_segv_handler();
  std::unique_lock protect_lock(g_protect_mutex, std::defer_lock);
  if (strict) protect_lock.lock();
  int prot = (strict && g_scopes == 0) ? PROT_NONE : (PROT_READ | PROT_WRITE);
  void* p = fd >= 0 ? mmap(nullptr, size, prot, MAP_SHARED | MAP_NORESERVE, fd, 0)
                    : mmap(nullptr, size, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  if (fd >= 0) g_segment_files.fetch_add(1, std::memory_order_relaxed);
  // [docs:end SEGMENT_MMAP]
  auto& r = registry();
  std::unique_lock lock(r.mutex);
  auto base = reinterpret_cast<uintptr_t>(p);
  r.segments.emplace(base, Segment{size, device, fd, imported});
  uintptr_t low = g_low.load();
  while (base < low && !g_low.compare_exchange_weak(low, base)) {
  }
  uintptr_t high = g_high.load();
  while (base + size > high && !g_high.compare_exchange_weak(high, base + size)) {
  }
  return p;
}

// [docs:start SEGMENT_FILE]
// The segment's memory is a file in the kernel's shared memory (memfd: no name in /dev/shm, its
// pages are freed when the last mapping and descriptor of it are gone, in whatever process).
// Each file holds a descriptor for the segment's lifetime. So that device memory never takes the
// program's own descriptors (a soft RLIMIT_NOFILE of 1024 is common), segments hold at most a
// quarter of the limit (at least 64); beyond that, or when memfd_create fails, a segment is
// anonymous memory: usable, not shareable (ipc_export says so).
int segment_file_budget() {
  static const int budget = [] {
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 1 << 20;
    return std::max<int>(64, static_cast<int>(limit.rlim_cur / 4));
  }();
  return budget;
}

int segment_file(int device, size_t size) {
  if (g_segment_files.load(std::memory_order_relaxed) >= segment_file_budget()) return -1;
  char name[32];
  snprintf(name, sizeof name, "openreg-device%d", device);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}
// [docs:end SEGMENT_FILE]

}  // namespace

bool strict_memory() noexcept {
  static const bool strict = [] {
    const char* env = std::getenv("OPENREG_STRICT_MEMORY");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }();
  return strict;
}

void* segment_alloc(int device, size_t size) {
  check_device(device);
  lazy_init();
  auto& r = registry();
  {
    std::unique_lock lock(r.mutex);
    if (r.used[device] + size > device_capacity()) return nullptr;
    r.used[device] += size;  // reserve before mapping so concurrent callers see the capacity
  }
  int fd = segment_file(device, size);
  void* p = map_segment(device, size, fd, /*imported=*/false);
  if (p == nullptr) {
    if (fd >= 0) close(fd);
    std::unique_lock lock(r.mutex);
    r.used[device] -= size;
  }
  return p;
}

void* segment_import(int device, int fd, size_t size) {
  check_device(device);
  lazy_init();
  void* p = map_segment(device, size, fd, /*imported=*/true);
  if (p == nullptr) close(fd);
  return p;
}

void segment_free(void* ptr) {
  if (ptr == nullptr) return;
  auto& r = registry();
  std::unique_lock lock(r.mutex);
  auto it = r.segments.find(reinterpret_cast<uintptr_t>(ptr));
  TORCH_INTERNAL_ASSERT(it != r.segments.end(), "openreg: freeing an unknown segment");
  if (!it->second.imported) r.used[it->second.device] -= it->second.size;
  munmap(ptr, it->second.size);
  if (it->second.fd >= 0) {
    close(it->second.fd);
    g_segment_files.fetch_sub(1, std::memory_order_relaxed);
  }
  r.segments.erase(it);
}

bool find_segment(const void* ptr, SegmentInfo& info) {
  auto addr = reinterpret_cast<uintptr_t>(ptr);
  auto& r = registry();
  std::shared_lock lock(r.mutex);
  auto it = r.segments.upper_bound(addr);
  if (it == r.segments.begin()) return false;
  --it;
  if (addr >= it->first + it->second.size) return false;
  info = SegmentInfo{reinterpret_cast<char*>(it->first), it->second.size, it->second.device,
                     it->second.fd};
  return true;
}

size_t driver_used(int device) {
  auto& r = registry();
  std::shared_lock lock(r.mutex);
  return r.used.at(device);
}

int device_of_pointer(const void* ptr) {
  auto addr = reinterpret_cast<uintptr_t>(ptr);
  auto& r = registry();
  std::shared_lock lock(r.mutex);
  auto it = r.segments.upper_bound(addr);
  if (it == r.segments.begin()) return -1;
  --it;
  if (addr < it->first + it->second.size) return it->second.device;
  return -1;
}

// [docs:start KERNEL_SCOPE]
void KernelScope::enter() {
  std::lock_guard guard(g_protect_mutex);
  if (g_scopes++ == 0) {
    std::shared_lock lock(registry().mutex);
    protect_all(PROT_READ | PROT_WRITE);
  }
}

void KernelScope::leave() {
  std::lock_guard guard(g_protect_mutex);
  if (--g_scopes == 0) {
    std::shared_lock lock(registry().mutex);
    protect_all(PROT_NONE);
  }
}
// [docs:end KERNEL_SCOPE]

}  // namespace openreg
