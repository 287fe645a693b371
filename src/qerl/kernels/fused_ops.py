"""The rollout engine's per-layer small ops, in one Triton launch each on CUDA, eager torch elsewhere.

  add_norm(h, delta, norm) -> (h + delta, norm(h + delta))   residual add + the model's RMSNorm
  rope_qk(q, k, cos, sin)  -> rotated (q, k)                   rotate-half RoPE, [B, L, heads, hd]

The Triton path (`triton_fused_ops`) is taken for CUDA bf16/fp16 tensors when the norm is a plain
Llama/Qwen-style RMSNorm (`weight` of the activation dtype and `variance_epsilon`); it rounds exactly
where the eager code does, so only the fp32 summation order inside the norm differs. It reads the norm's
weight tensor on every call, so an AQN perturbation applied in place is seen (CUDA graphs included).
QERL_DISABLE_TRITON=1 forces the eager path, as for the matmuls.
"""

import torch
from torch import nn

from .triton_gate import use_triton


def _rms_norm_params(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) when `norm` computes w * (x * rsqrt(mean(x^2) + eps)) as HF's Llama/Qwen RMSNorm does."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) or eps is None:
        return None
    if w.ndim != 1 or w.dtype != x.dtype or w.device != x.device or w.shape[0] != x.shape[-1]:
        return None
    return w, float(eps)


def add_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [..., D] -> (s, norm(s)) with s = h + delta (s = h when delta is None)."""
    params = _rms_norm_params(norm, h) if use_triton(h) else None
    if params is not None and (delta is None or (delta.dtype == h.dtype and delta.shape == h.shape)):
        from .triton_fused_ops import add_rms_norm

        return add_rms_norm(h.contiguous(), None if delta is None else delta.contiguous(), *params)
    s = h if delta is None else h + delta
    return s, norm(s)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, heads, hd]; cos, sin [B, L, hd] -> x * cos + rotate_half(x) * sin (HF's convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, L, H, hd], k [B, L, KV, hd]; cos, sin [B, L, hd] -> rotated (q, k), same shapes and dtype.
    On the Triton path q and k are rotated in place (they must be fresh tensors the caller owns)."""
    if use_triton(q) and cos.dtype == q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1:
        from .triton_fused_ops import rope_

        cos, sin = cos.contiguous(), sin.contiguous()
        return rope_(q, cos, sin), rope_(k, cos, sin)
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)
