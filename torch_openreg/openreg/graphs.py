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


class graph:
    """``with torch.openreg.graph(g):`` captures the block into ``g`` on a side stream, like
    ``torch.cuda.graph``: ``pool`` shares a memory pool with other graphs, ``stream`` chooses the
    capturing stream (default: a new side stream of the current device), ``capture_error_mode``
    is passed to the graph (``"global"``, ``"thread_local"``, ``"relaxed"``)."""

    def __init__(self, graph: torch.accelerator.Graph, pool: tuple[int, int] | None = None,
                 stream: torch.Stream | None = None, capture_error_mode: str = "global"):
        self.graph = graph
        self.stream = stream if stream is not None else torch.Stream(device="openreg")
        graph.graph_pool = pool
        graph.capture_error_mode = capture_error_mode

    def __enter__(self):
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
        self.stream.__enter__()
        try:
            self.graph.capture_begin()
        except BaseException:
            self.stream.__exit__(None, None, None)
            raise
        return self.graph

    def __exit__(self, *exc_info):
        try:
            self.graph.capture_end()
        finally:
            self.stream.__exit__(*exc_info)
        return False
# [docs:end PY_GRAPHS]
