"""Dense copies of quantized weights, scoped: `with dequantized_weights(): ...`.

Without a copy every quantized matmul reads the 4-bit tensors; where no fused kernel does that (the
plain-torch CPU path, NF4 on CUDA) it dequantizes the whole weight again on every call, once per decoded
token. Inside a scope each weight is dequantized once (per dtype) and the dense W is reused:

- on the CPU -- tests and the offline demo, where staying usable beats staying small -- rollouts and loss
  passes open a scope of their own, dropped on exit, so the 4-bit tensors remain the only copy that
  outlives the pass;
- on any device, a caller may pass a `store` (a dict it keeps) to keep the copies across scopes: the
  trainer's `model.dense_weights` option, which trades +2 bytes per weight for dense-matmul speed. The
  copies are the exact dequantization, so results match the 4-bit path up to matmul rounding.

CUDA graphs: a copy made during a capture would live in the graph's private pool, so a missing copy there is
an error; the engine's capture warm-ups (eager) make every copy first.
"""

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import get_format


@dataclass
class _Scope:
    cache: dict
    cuda: bool  # CUDA tensors use this scope (a caller-kept store); the per-pass CPU scopes leave them alone


_ACTIVE: ContextVar[_Scope | None] = ContextVar("qerl_dequant_cache", default=None)


@contextmanager
def dequantized_weights(enabled: bool = True, store: dict | None = None):
    """Inside, quantized matmuls dequantize each weight once (per dtype) and reuse it: CPU weights always,
    CUDA weights only with a `store` (kept by the caller across scopes, filled on first use)."""
    if not enabled or _ACTIVE.get() is not None:  # nested: the outer scope owns the cache
        yield
        return
    token = _ACTIVE.set(_Scope({} if store is None else store, store is not None))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def dense_weight_bytes(store: dict) -> int:
    """Bytes the dense copies in `store` hold."""
    return sum(w.numel() * w.element_size() for _, w in store.values())


def cached_dense_weight(fmt: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                        decode: Callable[[str, dict, torch.dtype], torch.Tensor] | None = None) -> torch.Tensor | None:
    """The dense W [N, K] in dtype from the active scope (made on first use), or None outside a scope and for
    CUDA tensors in a scope without a store. decode(fmt, tensors, dtype): another dense form of the weight to
    cache instead of its exact dequantization (e.g. the W4A8 weight, `qerl.kernels.fp8_matmul.w4a8_weight`)."""
    scope = _ACTIVE.get()
    first = next(iter(tensors.values()))
    if scope is None or (first.is_cuda and not scope.cuda):
        return None
    # shape too: a fused sibling group starts where its first member does
    key = (first.data_ptr(), tuple(first.shape), fmt, dtype, None if decode is None else decode.__name__)
    entry = scope.cache.get(key)
    if entry is None:
        if first.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a dense weight copy would be made inside a CUDA graph capture (its memory would "
                               "belong to the graph); run the step eagerly once first")
        # the entry holds the 4-bit tensor too: its memory cannot be freed and reused by another weight, so an
        # address seen again is the same weight, also in a store kept for a whole run
        dense = get_format(fmt).dequantize(**tensors, dtype=dtype) if decode is None else decode(fmt, tensors, dtype)
        entry = scope.cache[key] = (first, dense)
    return entry[1]
