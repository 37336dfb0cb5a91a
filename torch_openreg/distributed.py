"""The ``occl`` c10d backend: collectives on openreg tensors, through gloo (docs/distributed.md).

Registered when torch_openreg is imported (``import torch`` already imports
``torch.distributed``, so this adds nothing measurable to the import time)::

    dist.init_process_group()                          # CPU tensors -> gloo, openreg -> occl
    dist.init_process_group(device_id=torch.device("openreg", rank))   # the same
    dist.init_process_group("cpu:gloo,openreg:occl")   # the same, spelled out
    dist.init_process_group("occl")                    # openreg tensors only, like "nccl"

Each occl process group holds a gloo backend of the same ranks; every collective hands gloo CPU
tensors that alias the device memory (native side: csrc/adapters/distributed.cpp), so gloo's
transport (TCP, works across machines) reads and writes device memory in place.
"""

from __future__ import annotations

import datetime
import os

import torch

from torch_openreg import _C

__all__ = ["BACKEND_NAME", "DEFAULT_BACKEND", "checks_shapes", "create_backend"]

BACKEND_NAME = "occl"
# What a process group gets when no backend name is given: gloo for CPU tensors, occl for
# openreg tensors (`Backend.default_device_backend_map["openreg"]`).
DEFAULT_BACKEND = "cpu:gloo,openreg:occl"


def checks_shapes() -> bool:
    """Whether new occl groups compare each collective's shapes across ranks before running it
    (the default; ``OPENREG_OCCL_CHECK=0`` turns it off, on every rank alike: a rank that checks
    and one that does not cannot talk to each other)."""
    return os.environ.get("OPENREG_OCCL_CHECK", "1") != "0"


# [docs:start CREATE_BACKEND]
def create_backend(store, group_rank: int, group_size: int, timeout: datetime.timedelta):
    """The ``func`` of ``Backend.register_backend``: called by ``init_process_group`` and
    ``new_group`` with the group's prefixed store, rank, size and timeout."""
    from torch.distributed import ProcessGroupGloo

    gloo = ProcessGroupGloo(store, group_rank, group_size, timeout)
    return _C._occl_backend(gloo, check=checks_shapes())
# [docs:end CREATE_BACKEND]


# [docs:start DEFAULT_GROUP]
def _create_default_group(opts, backend_options=None):
    """``init_process_group()`` / ``new_group()`` without a backend name: torch 2.13 builds the
    group for the current accelerator only (``BackendConfig`` with the backend "undefined" looks
    up ``default_device_backend_map["openreg"]``), and makes GLOO the group's default backend
    without creating it. The name found there is ``DEFAULT_BACKEND``; its creator returns the
    whole ``ProcessGroup`` (torch uses a returned ProcessGroup as the group itself), with gloo
    for CPU tensors and occl, the default backend, for openreg tensors: the group that
    ``init_process_group("cpu:gloo,openreg:occl")`` builds."""
    from torch.distributed import PrefixStore, ProcessGroup, ProcessGroupGloo
    from torch.distributed import distributed_c10d as c10d

    store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
    group = ProcessGroup(store, rank, size)
    gloo = ProcessGroupGloo(PrefixStore("cpu/", store), rank, size, timeout)
    gloo.options.global_ranks_in_group = list(opts.global_ranks_in_group)
    gloo.options.group_name = opts.group_id
    gloo._set_sequence_number_for_group()
    occl = create_backend(PrefixStore("openreg/", store), rank, size, timeout)
    backends = {"cpu": (ProcessGroup.BackendType.GLOO, gloo),
                "openreg": (ProcessGroup.BackendType.CUSTOM, occl)}
    for device, (backend_type, backend) in backends.items():
        if c10d.get_debug_level() == c10d.DebugLevel.DETAIL:
            # what torch does for the backends it creates itself: check every collective's
            # shapes across ranks first
            backend = c10d._create_process_group_wrapper(
                wrapped_pg=backend, store_prefix=opts.group_id,
                store=PrefixStore(f"{device}/", store), rank=rank, world_size=size,
                timeout=timeout)
        group._register_backend(torch.device(device), backend_type, backend)
    group._set_default_backend(ProcessGroup.BackendType.CUSTOM)  # as NCCL is on CUDA
    return group


# [docs:start SPLIT_OPTIONS]
def _split_options(source):
    """``options`` of an occl backend: what ``split_group`` deep-copies and hands to
    ``ProcessGroup.split_group``. A copy of the options of the gloo backend underneath (gloo's
    own options object cannot be deep-copied), as a ``ProcessGroupGloo`` options object: torch
    may hand them to the group's gloo backend for CPU tensors too, which falls back to its
    defaults, timeout included, on any other kind."""
    global _SplitOptions
    if _SplitOptions is None:
        from torch.distributed import ProcessGroupGloo

        class SplitOptions(ProcessGroupGloo._Options):
            def __deepcopy__(self, memo):
                return _split_options(self)

        _SplitOptions = SplitOptions
    copy = _SplitOptions()
    for name in ("_timeout", "_devices", "_threads", "global_ranks_in_group", "group_name"):
        setattr(copy, name, getattr(source, name))
    return copy


_SplitOptions = None
# [docs:end SPLIT_OPTIONS]


def _register() -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return
    Backend = torch.distributed.Backend
    if BACKEND_NAME.upper() in Backend._plugins:
        return
    Backend.register_backend(BACKEND_NAME, create_backend, devices=["openreg"])
    _C._OcclBackend.options = property(lambda backend: _split_options(backend._gloo.options))
    # No backend name: "cpu:gloo,openreg:occl". With device_id=, torch parses the name itself
    # and builds both backends; without it, torch calls the creator registered under the name.
    # (Not through register_backend: that would list the name as one backend, and an explicit
    # init_process_group("cpu:gloo,openreg:occl") would then no longer be parsed per device.)
    Backend.default_device_backend_map["openreg"] = DEFAULT_BACKEND
    Backend._plugins[DEFAULT_BACKEND.upper()] = Backend._BackendPlugin(
        _create_default_group, True)
# [docs:end DEFAULT_GROUP]


_register()
