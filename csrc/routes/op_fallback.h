// Native because: the synchronizing-operator check runs inside native kernels (op_fallback.cpp,
// and _local_scalar_dense in ops/minimal_ops.cpp).
#pragma once

namespace openreg {

// torch.openreg.set_sync_debug_mode / get_sync_debug_mode: 0 default, 1 warn, 2 error.
void set_sync_debug_mode(int mode);
int get_sync_debug_mode();

// Warns or raises, per the mode, that `op` makes the host wait for the device.
void warn_or_error_on_sync(const char* op);

}  // namespace openreg
