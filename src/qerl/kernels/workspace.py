"""Buffers the kernels write: outputs, split-K partials, and the arrival counters kept for the process.

`alloc` is how every kernel wrapper allocates what it writes. Inside `poisoned_outputs()` (tests) those
buffers are filled with NaN first (the most negative integer for integer buffers: an impossible index), so
an element a kernel forgets to write shows up instead of passing as leftover memory; the switch is a
context variable, so it cannot outlive the test that sets it.

`persistent(owner, device, key, make)` holds the buffers that must outlive a call: the split-K arrival
counters (int32 zeros that every launch leaves at zero) and workspaces of the Gluon, LoRA-A and sampling
kernels. CUDA graphs keep their addresses, so they are made once per key and never freed. They are kept per
CUDA stream (the stream current at the call): launches in flight together on two streams never share a
counter or a partial sum, and launches on one stream run in order, so they may. A graph capture therefore
finds the buffers its warm-up made only when both ran on the same stream (`capture_graph` below does so).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

_POISON: ContextVar[bool] = ContextVar("qerl_poisoned_outputs", default=False)
_PERSISTENT: dict[tuple, object] = {}
T = TypeVar("T")


@contextmanager
def poisoned_outputs(enabled: bool = True) -> Iterator[None]:
    """Inside, `alloc` fills new buffers with NaN (floating) or the most negative integer (integer)."""
    token = _POISON.set(enabled)
    try:
        yield
    finally:
        _POISON.reset(token)


def alloc(shape, device, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized buffer for a kernel to write (poisoned inside `poisoned_outputs`)."""
    if _POISON.get():
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


def _full_key(owner: str, device: torch.device, key: tuple) -> tuple:
    # cuda_stream is the CUstream handle: unique among live streams. A destroyed stream's handle may be
    # reused by a new one, which then shares its buffers, also with graphs captured on the old stream: keep a
    # capture stream alive as long as its graphs run concurrently with other work (DecodeGraphs does)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    return (owner, device, stream, *key)


def persistent(owner: str, device: torch.device, key: tuple, make: Callable[[], T]) -> T:
    """The buffer(s) kept for the process under (owner, device, current stream, *key), made on first use."""
    full = _full_key(owner, device, key)
    if full not in _PERSISTENT:
        _PERSISTENT[full] = make()
    return _PERSISTENT[full]  # type: ignore[return-value]


def has_persistent(owner: str, device: torch.device, key: tuple) -> bool:
    """Whether `persistent(owner, device, key, ...)` on the current stream would allocate nothing."""
    return _full_key(owner, device, key) in _PERSISTENT


def counters(owner: str, device: torch.device, size: int) -> torch.Tensor:
    """int32 zeros [size] kept for the process, one per (owner, device, stream, size); launches leave them at
    zero."""
    return persistent(owner, device, (size,), lambda: torch.zeros(size, dtype=torch.int32, device=device))


def persistent_tensors(owner: str) -> list[torch.Tensor]:
    """Every tensor kept for `owner`, on every stream (tests check the counters are back at zero)."""
    out = []
    for key, v in _PERSISTENT.items():
        if key[0] == owner:
            out.extend(v if isinstance(v, tuple) else (v,))
    return out


def capture_graph(fn: Callable[[], T], warmups: int = 2, pool=None,
                  stream: "torch.cuda.Stream | None" = None) -> tuple["torch.cuda.CUDAGraph", T]:
    """(graph, fn's result in the capture): run fn `warmups` times (Triton compiles, cuBLAS picks kernels,
    the per-stream buffers above are made) and then capture one call, all on `stream` (default: a new side
    stream), so that the capture records the buffers the warm-up made. fn must be safe to run repeatedly on the
    same inputs. Replays may run on any stream."""
    s = stream if stream is not None else torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=s):
        out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph, out
