// Native because: a boxed kernel is a C++ function over the dispatcher's stack
// (torch::CppFunction::makeFromBoxedFunction), and it runs on the per-operator hot path.
//
// Route: a per-operator boxed kernel, next to the global fallback. The global fallback
// (ops/fallback.cpp, `TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(...); }`) serves every
// operator without a kernel of its own. A boxed kernel can also be registered for chosen operators
// only (`m.impl("nonzero", makeFromBoxedFunction<&f>())`): one function, written once against the
// generic stack, serves operators of any signature, and wins over the global fallback for them.
//
// openreg uses it for the operators whose result the host must wait for on a real accelerator
// (data-dependent output shapes, booleans): with torch.openreg.set_sync_debug_mode("warn" or
// "error") they warn or raise, as torch.cuda.set_sync_debug_mode does on CUDA, then run through
// the generic fallback. This tells CI users where their code would stall a real device.
#include "ops/fallback.h"
#include "routes/call_counter.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>

namespace openreg {
namespace {

std::atomic<int> sync_debug_mode{0};  // 0 default, 1 warn, 2 error (torch.cuda's values)
std::atomic<int64_t>& calls = call_counter("op_fallback.synchronizing");

}  // namespace

void set_sync_debug_mode(int mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "invalid value of debug_mode, expected one of 0,1,2");
  sync_debug_mode.store(mode);
}
int get_sync_debug_mode() { return sync_debug_mode.load(); }

void warn_or_error_on_sync(const char* op) {
  const int mode = sync_debug_mode.load(std::memory_order_relaxed);
  TORCH_CHECK(mode != 2, "called a synchronizing openreg operation (", op, ")");
  if (mode == 1) TORCH_WARN("called a synchronizing openreg operation (", op, ")");
}

namespace {

// [docs:start SYNCHRONIZING_OP]
// One boxed kernel for operators of different signatures: it only needs the operator's name, then
// hands the untouched stack to the generic fallback.
void synchronizing_op(const c10::OperatorHandle& op, c10::Stack* stack) {
  calls.fetch_add(1, std::memory_order_relaxed);
  warn_or_error_on_sync(op.schema().name().c_str());
  generic_fallback(op, stack);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"nonzero", "masked_select", "_unique2", "unique_dim",
                           "unique_consecutive", "equal"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&synchronizing_op>());
}
// [docs:end SYNCHRONIZING_OP]

}  // namespace
}  // namespace openreg
