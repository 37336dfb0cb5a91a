// Native because: every C++ path that hands device memory to a kernel calls it before the kernel.
//
// Copy-on-write (torch._lazy_clone, c10/core/impl/COW.h): a lazy clone and its source share one
// buffer until either is written; the first mutable access to a storage (StorageImpl::mutable_data)
// copies the buffer for it ("materializes" it), a read (data()) does not. openreg's kernels write
// through CPU aliases over the device storage's raw memory (ops/cpu_kernel.h), which cannot
// materialize the device storage: each argument an operator writes (alias annotation `!`, out=)
// is materialized here before its alias is made, inside the kernel's stream order; arguments it
// only reads stay shared, as on the CPU (docs/storage.md, "Copy-on-write").
#pragma once

#include "ops/fallback.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

namespace openreg {

// Whether the tensor's storage is a copy-on-write one (shared with a lazy clone).
bool is_cow(const at::Tensor& t);

// Materializes the storage of a device tensor the kernel is about to write, if it is a
// copy-on-write one: it gets its own copy of the memory, in device memory. Call it after the
// HostKernel (or LaunchScope) is made, so the copy is in stream order, and before the alias.
void materialize_written(const at::Tensor& device_tensor);
// The same for every argument a boxed call writes (the call's arguments start at stack[first]).
void materialize_written(const ArgSummary& s, const c10::Stack& stack, size_t first);
// Whether the call writes a copy-on-write tensor (the asynchronous mode runs it synchronously).
bool writes_cow(const ArgSummary& s, const c10::Stack& stack, size_t first);

// Which arguments the CPU's kernels write besides those the schema marks, or only in some calls:
// batch norm's running statistics (ArgSummary::running_stats, ::training).
void find_running_stats(const c10::FunctionSchema& schema, ArgSummary& s);

}  // namespace openreg
