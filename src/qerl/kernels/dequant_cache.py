"""A scoped cache of dequantized weights for the plain-torch path (CPU).

Without fused kernels every matmul would dequantize its whole weight again, once per decoded token. On
the CPU -- tests and the offline demo, where staying usable beats staying small -- a rollout or a loss
pass may instead keep one dense copy per weight for its duration: `with dequantized_weights(): ...`.
The cache is dropped on exit, so the 4-bit tensors remain the only copy that outlives the pass. CUDA
tensors never use it (the GPU path reads the 4-bit weights directly).
"""

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..formats import get_format

_ACTIVE: ContextVar[dict | None] = ContextVar("qerl_dequant_cache", default=None)


@contextmanager
def dequantized_weights(enabled: bool = True):
    """Inside, CPU quantized matmuls dequantize each weight once (per dtype) and reuse it."""
    if not enabled or _ACTIVE.get() is not None:  # nested: the outer scope owns the cache
        yield
        return
    token = _ACTIVE.set({})
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def cached_dense_weight(fmt: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """The dense W [N, K] in dtype from the active cache (filled on first use), or None outside a scope / on CUDA."""
    cache = _ACTIVE.get()
    first = next(iter(tensors.values()))
    if cache is None or first.is_cuda:
        return None
    key = (first.data_ptr(), tuple(first.shape), fmt, dtype)  # shape too: a fused sibling group starts where its first member does
    w = cache.get(key)
    if w is None:
        w = cache[key] = get_format(fmt).dequantize(**tensors, dtype=dtype)
    return w
