// Native because: a device storage received from another process is a mapping of that process's
// shared-memory segment file, and the counts that keep the sender's memory alive live in shared
// memory and are updated with atomic operations, from the C++ deleter c10 calls when the last
// tensor on the storage dies.
//
// The analogue of CUDA IPC (docs/ipc.md). The sender exports the whole segment the storage lives
// in (like a whole cudaMalloc block) with the storage's offset in it; the receiver maps the
// segment once and builds its storage at that offset. Each export takes one count in a file of
// reference counts shared with the receiver; the sender keeps the storage alive (its memory is
// not reused) until the receiver has dropped that count.
#include "adapters/ipc.h"

#include "runtime/device.h"
#include "runtime/memory.h"

#include <c10/util/Exception.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <map>
#include <memory>
#include <mutex>
#include <iterator>
#include <utility>
#include <vector>

namespace openreg {
namespace {

// One slot per export: the count the receiver holds, and the receiving process (0 until it has
// built its storage), so that a receiver that exits without releasing (multiprocessing children
// end with os._exit, a killed process runs nothing) does not pin the sender's memory forever.
struct Slot {
  std::atomic<int64_t> count;
  std::atomic<int64_t> holder;
};
static_assert(sizeof(Slot) == 16 && std::atomic<int64_t>::is_always_lock_free);
constexpr size_t kSlotsPerFile = 2048;

bool released(const Slot& slot) {
  if (slot.count.load(std::memory_order_acquire) <= 0) return true;
  int64_t pid = slot.holder.load(std::memory_order_acquire);
  return pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

using FileId = std::pair<dev_t, ino_t>;

FileId file_id(int fd, off_t* size = nullptr) {
  struct stat st;
  TORCH_CHECK(fstat(fd, &st) == 0, "openreg IPC: invalid file descriptor ", fd);
  if (size != nullptr) *size = st.st_size;
  return {st.st_dev, st.st_ino};
}

// ---------------------------------------------------------------- sender

// [docs:start COUNT_FILE]
// A file of reference counts, one slot per export, mapped by the sender and by the
// receivers (CUDA's IPC keeps the same kind of file).
struct CountFile {
  int fd = -1;
  Slot* slots = nullptr;
  std::vector<bool> used = std::vector<bool>(kSlotsPerFile, false);
  size_t in_use = 0;
  size_t next = 0;

  static std::shared_ptr<CountFile> create() {
    auto f = std::make_shared<CountFile>();
    f->fd = memfd_create("openreg-ipc-counts", MFD_CLOEXEC);
    TORCH_CHECK(f->fd >= 0, "openreg IPC: cannot create a shared-memory file for reference counts");
    TORCH_CHECK(ftruncate(f->fd, kSlotsPerFile * sizeof(Slot)) == 0,
                "openreg IPC: cannot size the reference-count file");
    void* p = mmap(nullptr, kSlotsPerFile * sizeof(Slot), PROT_READ | PROT_WRITE, MAP_SHARED,
                   f->fd, 0);
    TORCH_CHECK(p != MAP_FAILED, "openreg IPC: cannot map the reference-count file");
    f->slots = static_cast<Slot*>(p);
    return f;
  }
  ~CountFile() {
    if (slots != nullptr) munmap(slots, kSlotsPerFile * sizeof(Slot));
    if (fd >= 0) close(fd);
  }
};

struct Sent {
  c10::Storage storage;  // keeps the memory from being freed and reused while a receiver uses it
  std::shared_ptr<CountFile> file;
  size_t slot;
};

struct Sender {
  std::mutex mutex;
  std::vector<Sent> sent;
  std::shared_ptr<CountFile> current;
};

Sender& sender() {
  static auto* s = new Sender();  // leaked: exported storages stay until the process exits
  return *s;
}
// [docs:end COUNT_FILE]

// ---------------------------------------------------------------- receiver

// A segment of another process mapped here, shared by every storage built on it.
struct Mapping {
  char* base;
  ~Mapping() { segment_free(base); }
};

struct CountMap {
  Slot* slots;
  size_t size;
  ~CountMap() { munmap(slots, size); }
};

struct Receiver {
  std::mutex mutex;
  std::map<FileId, std::weak_ptr<Mapping>> segments;
  std::map<FileId, std::weak_ptr<CountMap>> counts;
};

Receiver& receiver() {
  static auto* r = new Receiver();  // leaked: storages may die during interpreter teardown
  return *r;
}

// Drops the entries of files no longer mapped here (called when a new one is mapped).
template <typename T>
void forget_unmapped(std::map<FileId, std::weak_ptr<T>>& files) {
  for (auto it = files.begin(); it != files.end();)
    it = it->second.expired() ? files.erase(it) : std::next(it);
}

std::shared_ptr<CountMap> open_counts(int fd, size_t size) {
  off_t file_size = 0;
  FileId id = file_id(fd, &file_size);
  TORCH_CHECK(size > 0 && size % sizeof(Slot) == 0 && size_t(file_size) >= size,
              "openreg IPC: the reference-count file does not match its handle");
  auto& r = receiver();
  std::lock_guard lock(r.mutex);
  if (auto existing = r.counts[id].lock()) return existing;
  forget_unmapped(r.counts);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(p != MAP_FAILED, "openreg IPC: cannot map the reference-count file");
  auto m = std::shared_ptr<CountMap>(new CountMap{static_cast<Slot*>(p), size});
  r.counts[id] = m;
  return m;
}

// [docs:start RECEIVED_DELETER]
// The context of a received storage's DataPtr: the mapping it lives in and the export's count.
// When the last tensor on the storage dies, the count drops (the sender may then reuse the
// memory) and the mapping goes with the last storage built on it.
struct Received {
  std::shared_ptr<Mapping> mapping;
  std::shared_ptr<CountMap> counts;
  size_t slot;
};

void delete_received(void* ctx) {
  auto* r = static_cast<Received*>(ctx);
  r->counts->slots[r->slot].count.fetch_sub(1, std::memory_order_acq_rel);
  delete r;
}
// [docs:end RECEIVED_DELETER]

}  // namespace

// [docs:start EXPORT]
IpcHandle ipc_export(const c10::Storage& storage) {
  const void* data = storage.data();
  SegmentInfo seg;
  TORCH_CHECK(data != nullptr && find_segment(data, seg),
              "openreg IPC: the storage is not in openreg device memory");
  TORCH_CHECK(seg.fd >= 0,
              "openreg IPC: this storage's device memory cannot be shared: its segment has no "
              "shared-memory file (when it was allocated, device segments already held a quarter "
              "of RLIMIT_NOFILE in descriptors, or memfd_create failed; raise the limit with "
              "`ulimit -n` to share more segments)");
  // The receiver's storage is a fixed window of the segment: a resize here would move this
  // storage's memory away from it (CUDA refuses to resize a received storage for the same reason).
  storage.unsafeGetStorageImpl()->set_resizable(false);
  ipc_collect();
  auto& s = sender();
  std::lock_guard lock(s.mutex);
  if (!s.current || s.current->in_use == kSlotsPerFile) s.current = CountFile::create();
  CountFile& f = *s.current;
  while (f.used[f.next]) f.next = (f.next + 1) % kSlotsPerFile;
  size_t slot = f.next;
  f.used[slot] = true;
  f.in_use++;
  f.slots[slot].holder.store(0, std::memory_order_relaxed);
  f.slots[slot].count.store(1, std::memory_order_release);  // owned by the receiver from now on
  s.sent.push_back(Sent{storage, s.current, slot});
  return IpcHandle{seg.device, seg.fd, seg.size, size_t(static_cast<const char*>(data) - seg.base),
                   storage.nbytes(), f.fd, kSlotsPerFile * sizeof(Slot), slot};
}
// [docs:end EXPORT]

size_t ipc_collect() {
  std::vector<Sent> done;  // destroyed after the lock is released (their deleters free memory)
  size_t pending = 0;
  {
    auto& s = sender();
    std::lock_guard lock(s.mutex);
    std::vector<Sent> keep;
    for (auto& e : s.sent) {
      if (!released(e.file->slots[e.slot])) {
        keep.push_back(std::move(e));
        continue;
      }
      e.file->used[e.slot] = false;
      e.file->in_use--;
      done.push_back(std::move(e));
    }
    s.sent = std::move(keep);
    pending = s.sent.size();
  }
  return pending;
}

void ipc_release(int counter_fd, size_t counter_size, size_t counter_slot) {
  auto counts = open_counts(counter_fd, counter_size);
  TORCH_CHECK(counter_slot < counter_size / sizeof(Slot), "openreg IPC: invalid count slot");
  counts->slots[counter_slot].count.fetch_sub(1, std::memory_order_acq_rel);
}

// [docs:start IMPORT]
c10::Storage ipc_import(const IpcHandle& h) {
  auto counts = open_counts(h.counter_fd, h.counter_size);
  TORCH_CHECK(h.counter_slot < h.counter_size / sizeof(Slot), "openreg IPC: invalid count slot");
  std::shared_ptr<Mapping> mapping;
  try {
    check_device(h.device);  // "openreg device index is out of range" on a smaller receiver
    lazy_init();
    off_t file_size = 0;
    FileId id = file_id(h.segment_fd, &file_size);
    TORCH_CHECK(size_t(file_size) >= h.segment_size && h.offset <= h.segment_size &&
                    h.nbytes <= h.segment_size - h.offset,
                "openreg IPC: the storage (offset ", h.offset, ", ", h.nbytes,
                " bytes) does not fit the shared segment of ", h.segment_size, " bytes");
    auto& r = receiver();
    std::lock_guard lock(r.mutex);
    mapping = r.segments[id].lock();
    if (!mapping) {
      forget_unmapped(r.segments);
      int fd = dup(h.segment_fd);
      TORCH_CHECK(fd >= 0, "openreg IPC: cannot duplicate the segment's file descriptor");
      void* base = segment_import(h.device, fd, h.segment_size);
      TORCH_CHECK(base != nullptr, "openreg IPC: cannot map a shared device segment of ",
                  h.segment_size, " bytes");
      mapping = std::shared_ptr<Mapping>(new Mapping{static_cast<char*>(base)});
      r.segments[id] = mapping;
    }
  } catch (...) {
    counts->slots[h.counter_slot].count.fetch_sub(1, std::memory_order_acq_rel);  // the sender may free it
    throw;
  }
  c10::Device device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(h.device));
  counts->slots[h.counter_slot].holder.store(getpid(), std::memory_order_release);
  char* data = mapping->base + h.offset;
  auto* ctx = new Received{std::move(mapping), std::move(counts), h.counter_slot};
  c10::DataPtr ptr(data, ctx, &delete_received, device);
  return c10::Storage(c10::Storage::use_byte_size_t(), h.nbytes, std::move(ptr),
                      /*allocator=*/nullptr, /*resizable=*/false);
}
// [docs:end IMPORT]

}  // namespace openreg
