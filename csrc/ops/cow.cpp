// Native because: every C++ path that hands device memory to a kernel calls it before the kernel.
#include "ops/cow.h"

#include <c10/core/StorageImpl.h>
#include <c10/core/impl/COW.h>

namespace openreg {

// [docs:start COW_MATERIALIZE]
bool is_cow(const at::Tensor& t) {
  return t.defined() && t.has_storage() &&
         c10::impl::cow::is_cow_data_ptr(t.unsafeGetTensorImpl()->unsafe_storage().data_ptr());
}

void materialize_written(const at::Tensor& t) {
  if (!is_cow(t) || t.device().type() != c10::DeviceType::PrivateUse1) return;
  // torch's own materialization: the last holder of the shared buffer takes it over, any other
  // gets a copy from the storage's allocator (the device's: its copy_data runs with device
  // memory accessible). The same as a CPU kernel's mutable_data_ptr() does on the CPU.
  t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()->mutable_data();
}
// [docs:end COW_MATERIALIZE]

// [docs:start COW_RUNNING_STATS]
// The schema's `!` says which arguments an operator may write; the CPU's batch norm kernels write
// the running statistics exactly when `training` is true (and materialize them only then), which
// native_batch_norm and batch_norm_update_stats (always training) do not mark at all and
// _native_batch_norm_legit marks for every call. openreg materializes them as the CPU does.
void find_running_stats(const c10::FunctionSchema& schema, ArgSummary& s) {
  const std::string& name = schema.name();
  const std::string& overload = schema.overload_name();
  if (overload != "" && overload != "out") return;  // _native_batch_norm_legit.no_stats: none
  if (name == "aten::native_batch_norm" || name == "aten::_native_batch_norm_legit") {
    s.running_stats = 3;
    s.training = 5;
  } else if (name == "aten::batch_norm_update_stats") {
    s.running_stats = 1;
  }
}
// [docs:end COW_RUNNING_STATS]

namespace {

bool written(const ArgSummary& s, const c10::Stack& stack, size_t first, size_t i) {
  if (s.running_stats >= 0 && (i == size_t(s.running_stats) || i == size_t(s.running_stats) + 1)) {
    if (s.training < 0) return true;
    const c10::IValue& training = stack[first + s.training];
    return training.isBool() && training.toBool();
  }
  return s.writes[i];
}

}  // namespace

void materialize_written(const ArgSummary& s, const c10::Stack& stack, size_t first) {
  if (!s.any_writes && s.running_stats < 0) return;
  for (size_t i = 0; i < s.writes.size(); ++i)
    if (written(s, stack, first, i))
      for_each_tensor(stack[first + i], s.kinds[i],
                      [](const at::Tensor& t) { materialize_written(t); });
}

bool writes_cow(const ArgSummary& s, const c10::Stack& stack, size_t first) {
  if (!s.any_writes && s.running_stats < 0) return false;
  bool found = false;
  for (size_t i = 0; i < s.writes.size() && !found; ++i)
    if (written(s, stack, first, i))
      for_each_tensor(stack[first + i], s.kinds[i],
                      [&](const at::Tensor& t) { found |= is_cow(t); });
  return found;
}

}  // namespace openreg
