// Native because: these operators manage device memory and tensor metadata directly (factories,
// views, set_, resize_, copies); PyTorch's generic fallback cannot express them.
#pragma once

#include <c10/core/StorageImpl.h>

namespace openreg {

// Grows or shrinks a device storage in place, keeping its first bytes (untyped_storage().resize_(),
// resize_ of a tensor whose storage is too small).
void resize_storage_bytes(c10::StorageImpl* storage, size_t new_bytes);

}  // namespace openreg
