"""CUDA graphs of the decode step: captured once per (batch bucket, attended cache length), then replayed.

A captured step reads and writes only static buffers (the KV cache, the engine's step inputs and
`step_logits`, the adapter snapshot), so replaying it after those buffers were updated in place runs the
new step. The graphs are dropped when anything they read is reallocated (a new batch bucket, a changed
adapter set, `invalidate_graphs`).
"""

from typing import Callable

import torch

from ..kernels.workspace import capture_graph


class DecodeGraphs:
    """The captured decode steps, keyed by (batch bucket, attended cache length), in one memory pool."""

    def __init__(self):
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._mempool = None
        self._stream: torch.cuda.Stream | None = None

    def replay(self, key: tuple[int, int], step: Callable[[], object]) -> None:
        """Replay the graph of `key`, capturing `step` (one decode step on static buffers) first if there
        is none yet."""
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(step)
        graph.replay()

    def _capture(self, step: Callable[[], object]) -> "torch.cuda.CUDAGraph":
        """Warm up and capture one step on this object's side stream (`kernels.workspace.capture_graph`).

        Warm-up runs write the same k/v the real step will write (same inputs), so they are harmless.
        """
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        graph, _ = capture_graph(step, warmups=2, pool=self._pool(), stream=self._stream)
        return graph

    def _pool(self):
        # one memory pool for all graphs: they never run concurrently and each writes its result to the
        # static step_logits before the next replay, so their temporaries may share memory
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        return self._mempool

    def reset(self) -> None:
        """Drop every captured graph and their pool (a new pool: capturing into the pool of destroyed
        graphs trips the caching allocator)."""
        self.graphs = {}
        self._mempool = None
