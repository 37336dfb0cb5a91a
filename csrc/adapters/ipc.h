// Native because: sharing device memory between processes (adapters/ipc.cpp) maps shared-memory
// files and keeps reference counts in shared memory, which only native code can do.
#pragma once

#include <c10/core/Storage.h>

#include <cstddef>
#include <cstdint>

namespace openreg {

// What a receiving process needs to map an exported storage.
struct IpcHandle {
  int device;
  int segment_fd;         // the segment's shared-memory file (owned by this process: dup to send)
  size_t segment_size;
  size_t offset;          // of the storage's first byte in the segment
  size_t nbytes;          // of the storage
  int counter_fd;         // the file of reference counts
  size_t counter_size;
  size_t counter_slot;    // this export's count in it
};

// Exports a device storage: the storage stays alive in this process (the memory is not reused)
// until the receiver has released what it built on it and ipc_collect() has run.
IpcHandle ipc_export(const c10::Storage& storage);

// Builds a device storage on the exported memory. Raises (after releasing the export's count) on
// a device this process does not have or a handle that does not fit the files.
c10::Storage ipc_import(const IpcHandle& handle);

// Releases an export's count without mapping its memory (the receiver already has the storage).
void ipc_release(int counter_fd, size_t counter_size, size_t counter_slot);

// Frees the exported storages whose receivers have released them; returns how many are still
// held by a receiver. Called by torch.openreg.ipc_collect and by the allocator before an OOM.
size_t ipc_collect();

}  // namespace openreg
