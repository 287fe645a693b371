"""Buffers the kernels write: outputs, split-K partials, and the arrival counters kept for the process.

`alloc` is how every kernel wrapper allocates what it writes. Inside `poisoned_outputs()` (tests) those
buffers are filled with NaN first (the most negative integer for integer buffers: an impossible index), so
an element a kernel forgets to write shows up instead of passing as leftover memory; the switch is a
context variable, so it cannot outlive the test that sets it.

`persistent(key, make)` holds the buffers that must outlive a call: the split-K arrival counters (int32
zeros that every launch leaves at zero) and workspaces of the Gluon, LoRA-A and sampling kernels. CUDA
graphs keep their addresses, so they are made once per key and never freed. One stream at a time: two
launches of the same key in flight on different streams would share them.
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


def persistent(key: tuple, make: Callable[[], T]) -> T:
    """The buffer(s) kept for the process under key (include the owner's name and the device), made on first use."""
    if key not in _PERSISTENT:
        _PERSISTENT[key] = make()
    return _PERSISTENT[key]  # type: ignore[return-value]


def has_persistent(key: tuple) -> bool:
    return key in _PERSISTENT


def counters(owner: str, device: torch.device, size: int) -> torch.Tensor:
    """int32 zeros [size] kept for the process, one per (owner, device, size); launches leave them at zero."""
    return persistent((owner, device, size), lambda: torch.zeros(size, dtype=torch.int32, device=device))


def persistent_tensors(owner: str) -> list[torch.Tensor]:
    """Every tensor kept for `owner` (tests check the counters are back at zero)."""
    out = []
    for key, v in _PERSISTENT.items():
        if key[0] == owner:
            out.extend(v if isinstance(v, tuple) else (v,))
    return out
