"""Validation shared by the quantizers: every bad weight is refused with one message naming the problem."""

import torch


def check_weight(w: torch.Tensor, block: int, fmt: str, name: str = "weight") -> None:
    """Raise ValueError unless w is a finite 2-D float matrix whose rows split into whole blocks."""
    if w.ndim != 2:
        raise ValueError(f"{fmt}: {name} must be 2-D [out, in], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{fmt}: {name} must be a float tensor, got {w.dtype}")
    if w.shape[1] % block:
        raise ValueError(
            f"{fmt}: {name} has {w.shape[1]} input features, not a multiple of the block size {block}"
        )
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).sum().item()
        raise ValueError(f"{fmt}: {name} has {bad} non-finite values (NaN/Inf); refusing to quantize it")
