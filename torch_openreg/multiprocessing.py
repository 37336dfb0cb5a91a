"""Device tensors across processes (IPC): the ``torch.multiprocessing`` reductions of openreg.

Registered when torch_openreg is imported. With the ``spawn`` start method, an ``openreg`` tensor
put on a ``torch.multiprocessing.Queue`` or passed to a spawned process arrives as an ``openreg``
tensor on the same device, sharing the sender's device memory (docs/ipc.md)::

    q.put(t)            # sender: t = torch.ones(4, device="openreg:1")
    t = q.get()         # receiver: same memory, device openreg:1

Only storages need a reduction of their own: torch's ``reduce_tensor`` already sends a tensor of
any non-CUDA device as its storage (pickled through the storage reduction registered here) with
its size, stride, storage offset, dtype and ``requires_grad``, and rebuilds it on that storage.
Everything that is not an openreg storage goes to torch's own reductions.
"""

from __future__ import annotations

import os
from multiprocessing.reduction import DupFd, ForkingPickler

import torch
import torch.multiprocessing.reductions as _torch_reductions

from torch_openreg import _C

__all__: list[str] = []

# torch.openreg.ipc_collect() frees the storages sent to processes that have released them.

# Storages sent or received by this process, by (segment file, offset, size): a storage received
# twice (or sent back to its sender) is the same storage object, as for CUDA.
_shared_cache = _torch_reductions.SharedCache()


def _cached(key):
    ref = _shared_cache.get(key)
    if ref is None or ref.expired():
        return None
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


# [docs:start REDUCE_STORAGE]
def _reduce_storage(storage):
    if storage.device.type != "openreg":
        return _torch_reductions.reduce_storage(storage)
    if storage.nbytes() == 0:
        return (_rebuild_empty_storage, (storage.device.index,))
    # Work queued before the send must have written the memory the receiver will read. This runs
    # in the queue's feeder thread, whose current stream is not the user's: wait for the whole
    # device (CUDA has the receiver wait on an event recorded here instead: see docs/ipc.md).
    torch.openreg.synchronize(storage.device)
    device, seg_fd, seg_size, offset, nbytes, count_fd, count_size, slot = _C._ipc_export(storage)
    _shared_cache[(_torch_reductions.fd_id(seg_fd), offset, nbytes)] = (
        _torch_reductions.StorageWeakRef(storage)
    )
    return (
        _rebuild_storage,
        (device, DupFd(seg_fd), seg_size, offset, nbytes, DupFd(count_fd), count_size, slot,
         os.getpid()),
    )
# [docs:end REDUCE_STORAGE]


def _rebuild_empty_storage(device):
    return torch.UntypedStorage(0, device=torch.device("openreg", device))


# [docs:start REBUILD_STORAGE]
def _rebuild_storage(device, seg_df, seg_size, offset, nbytes, count_df, count_size, slot, pid):
    try:
        seg_fd = seg_df.detach()
        count_fd = count_df.detach()
    except (OSError, EOFError) as e:
        # The file descriptors are handed over by the sender's process (multiprocessing's
        # resource sharer): once it has exited, the memory can no longer be reached.
        raise RuntimeError(
            f"openreg IPC: cannot receive a device tensor from process {pid}: that process exited "
            "before this process received it. Keep the sending process alive until the receiver "
            "has taken the tensor from the queue (as with CUDA tensors)."
        ) from e
    try:
        key = (_torch_reductions.fd_id(seg_fd), offset, nbytes)
        storage = _cached(key)
        if storage is not None:
            _C._ipc_release(count_fd, count_size, slot)
            return storage
        storage = _C._ipc_import(device, seg_fd, seg_size, offset, nbytes, count_fd, count_size, slot)
        _shared_cache[key] = _torch_reductions.StorageWeakRef(storage)
        return storage
    finally:
        os.close(seg_fd)
        os.close(count_fd)
# [docs:end REBUILD_STORAGE]


def _reduce_legacy_storage(storage):
    return (_torch_reductions.rebuild_typed_storage_child, (storage._untyped_storage, type(storage)))


# [docs:start REGISTER]
def _register() -> None:
    ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
    # torch.openreg.FloatStorage and friends: through their untyped storage, like torch's classes.
    from torch_openreg.openreg import storage as legacy

    for name in legacy.__all__:
        ForkingPickler.register(getattr(legacy, name), _reduce_legacy_storage)
# [docs:end REGISTER]


_register()
