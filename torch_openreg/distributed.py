"""The ``occl`` c10d backend: collectives on openreg tensors, through gloo (docs/distributed.md).

Registered when torch_openreg is imported (``import torch`` already imports
``torch.distributed``, so this adds nothing measurable to the import time)::

    dist.init_process_group()                          # openreg tensors -> occl
    dist.init_process_group("cpu:gloo,openreg:occl")   # and CPU tensors -> gloo
    dist.init_process_group("occl")

Each occl process group holds a gloo backend of the same ranks; every collective hands gloo CPU
tensors that alias the device memory (native side: csrc/adapters/distributed.cpp), so gloo's
transport (TCP, works across machines) reads and writes device memory in place.
"""

from __future__ import annotations

import datetime

import torch

from torch_openreg import _C

__all__ = ["BACKEND_NAME", "create_backend"]

BACKEND_NAME = "occl"


# [docs:start CREATE_BACKEND]
def create_backend(store, group_rank: int, group_size: int, timeout: datetime.timedelta):
    """The ``func`` of ``Backend.register_backend``: called by ``init_process_group`` and
    ``new_group`` with the group's prefixed store, rank, size and timeout."""
    from torch.distributed import ProcessGroupGloo

    gloo = ProcessGroupGloo(store, group_rank, group_size, timeout)
    return _C._occl_backend(gloo)


def _register() -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return
    Backend = torch.distributed.Backend
    if BACKEND_NAME.upper() in Backend._plugins:
        return
    Backend.register_backend(BACKEND_NAME, create_backend, devices=["openreg"])
# [docs:end CREATE_BACKEND]


_register()
