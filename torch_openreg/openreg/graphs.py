"""Graph helpers of ``torch.openreg``, the ``torch.cuda`` counterparts (docs/graphs.md).

Capture and replay themselves are ``torch.accelerator.Graph``, served by the native
``GraphImplInterface`` of openreg (csrc/adapters/graph.cpp); nothing here re-implements them.
"""

from __future__ import annotations

import itertools

import torch

_pool_ids = itertools.count(1)


# [docs:start PY_GRAPHS]
def is_current_stream_capturing() -> bool:
    """Whether the current stream of the current device is capturing a graph
    (``torch.cuda.is_current_stream_capturing``)."""
    return torch.accelerator.current_stream().is_capturing()


def graph_pool_handle() -> tuple[int, int]:
    """A new memory-pool id for ``torch.accelerator.Graph(pool=...)``: graphs given the same id
    share one private pool (``torch.cuda.graph_pool_handle``). Ids of this form (0, n) never
    collide with the ids graphs create for themselves (n, 0)."""
    return (0, next(_pool_ids))
# [docs:end PY_GRAPHS]
