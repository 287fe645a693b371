"""The rollout engine's per-layer small ops, in one Triton launch each on CUDA, eager torch elsewhere.

  add_norm(h, delta, norm) -> (h + delta, norm(h + delta))   residual add + the model's RMSNorm
  add_norm_lora_a(h, delta, norm, a)
                           -> the same and norm(h + delta) @ a^T  (+ the LoRA A product of the linears the norm
                              feeds, in the same launch at decode rows; None where it is not fused)
  rope_qk(q, k, cos, sin)  -> rotated (q, k)                   rotate-half RoPE, [B, L, heads, hd]
  silu_mul(gate, up)       -> silu(gate) * up                  the MLP's activation and product
  silu_mul_lora_a(gate, up, act, a)
                           -> the same and (silu(gate) * up) @ a^T  (+ the down projection's LoRA A product, in the
                              same launch at decode rows; None where it is not fused)
  rope_qk_store(q, k, v, cos, sin, k_cache, v_cache, slot)
                           -> rotated q; rotated k and v written into the caches at the device-side slot
                              (one decode token: RoPE + the cache write, in one launch)

The Triton path (`triton.fused_ops`) is taken for CUDA bf16/fp16 tensors when the norm is a plain
Llama/Qwen-style RMSNorm (`weight` of the activation dtype and `variance_epsilon`), the activation is SiLU,
and the layouts fit (unit stride on the last dim); it rounds exactly where the eager code does, so only the
fp32 summation order inside the norm differs. It reads the norm's weight tensor on every call, so an AQN
perturbation applied in place is seen (CUDA graphs included). QERL_DISABLE_TRITON=1 forces the eager path,
as for the matmuls.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .route import rows, use_triton

NORM_LORA_A_MAX_ROWS = 64  # rows up to which the norm launch also does the LoRA A product (decode batches)
# True: the engine's decode has the SwiGLU launch also compute the down projection's LoRA A product (one launch
# fewer per layer and step). Off: measured 5-11% slower per step than the two launches it replaces
# (docs/benchmarks.md "Decode step against its floor") on a narrower grid and a one-load-a-part sum; the wider
# grid and the tiled sum are not timed yet
FUSED_SILU_LORA_A = False
SILU_LORA_A_MAX_R = 128  # above it an [R, 128] tile of A per step spills registers: the separate LoRA A launch


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
        from .triton.fused_ops import add_rms_norm

        return add_rms_norm(h.contiguous(), None if delta is None else delta.contiguous(), *params)
    s = h if delta is None else h + delta
    return s, norm(s)


def add_norm_lora_a(h: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module, a: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """h, delta [..., D]; a [R, D] (a stacked LoRA A, or None) -> (s, norm(s), norm(s) @ a^T as [M, R] or None).

    The product rides in the norm's launch (`triton.fused_ops.add_rms_norm_lora_a`: each row's norm is
    recomputed per block of a's rows, so only for up to NORM_LORA_A_MAX_ROWS rows) where the Triton norm
    applies and a is contiguous of h's dtype; elsewhere the third value is None and the caller computes the
    product itself (`kernels.lora_a`)."""
    if (a is not None and use_triton(h) and rows(h) <= NORM_LORA_A_MAX_ROWS and a.dtype == h.dtype
            and a.is_contiguous() and a.shape[-1] == h.shape[-1]):
        params = _rms_norm_params(norm, h)
        if params is not None and (delta is None or (delta.dtype == h.dtype and delta.shape == h.shape)):
            from .triton.fused_ops import add_rms_norm_lora_a

            return add_rms_norm_lora_a(h.contiguous(), None if delta is None else delta.contiguous(), *params, a)
    return (*add_norm(h, delta, norm), None)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, heads, hd]; cos, sin [B, L, hd] -> x * cos + rotate_half(x) * sin (HF's convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, L, H, hd], k [B, L, KV, hd]; cos, sin [B, L, hd] -> rotated (q, k), same shapes and dtype.
    On the Triton path q and k are rotated in place (they must be fresh tensors the caller owns)."""
    if use_triton(q) and cos.dtype == q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1:
        from .triton.fused_ops import rope_

        cos, sin = cos.contiguous(), sin.contiguous()
        return rope_(q, cos, sin), rope_(k, cos, sin)
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


def _is_plain_silu(act_fn: nn.Module | None) -> bool:
    """act_fn computes F.silu(x) out of place (None stands for it): HF's SiLUActivation or torch's nn.SiLU."""
    if act_fn is None:
        return True
    cls = type(act_fn)
    if getattr(act_fn, "inplace", False):  # eager would also overwrite gate: keep that side effect eager
        return False
    return cls is nn.SiLU or (cls.__name__ == "SiLUActivation" and cls.__module__.startswith("transformers."))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, act_fn: nn.Module | None = None) -> torch.Tensor:
    """gate, up [..., I] -> act_fn(gate) * up [..., I] (act_fn None: SiLU), a new tensor of their dtype.

    gate and up may be column slices of one [..., 2I] output (strided rows). The Triton path, bit-identical
    to the eager SiLU, for CUDA bf16/fp16 with a SiLU act_fn and unit stride on the last dim.
    """
    if (_is_plain_silu(act_fn) and use_triton(gate) and up.dtype == gate.dtype and up.shape == gate.shape
            and up.device == gate.device and gate.stride(-1) == 1 and up.stride(-1) == 1):
        from .triton.fused_ops import silu_mul as triton_silu_mul

        return triton_silu_mul(gate, up)
    return (F.silu(gate) if act_fn is None else act_fn(gate)) * up


def silu_mul_lora_a(gate: torch.Tensor, up: torch.Tensor, act_fn: nn.Module | None, a: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gate, up [..., I]; a [R, I] (the down projection's stacked LoRA A, or None) -> (act_fn(gate) * up,
    that @ a^T as [M, R] or None). The product rides in the SwiGLU launch (`triton.fused_ops.silu_mul_lora_a`)
    where the Triton SwiGLU applies, for up to NORM_LORA_A_MAX_ROWS rows, a contiguous of gate's dtype; elsewhere
    the second value is None and the caller computes the product itself (`kernels.lora_a`)."""
    if (a is not None and _is_plain_silu(act_fn) and use_triton(gate) and rows(gate) <= NORM_LORA_A_MAX_ROWS
            and up.dtype == gate.dtype == a.dtype and up.shape == gate.shape and a.is_contiguous()
            and a.shape[-1] == gate.shape[-1] and gate.stride(-1) == 1 and up.stride(-1) == 1
            and a.shape[0] <= SILU_LORA_A_MAX_R):
        from .triton import fused_ops as triton_fused_ops

        # inside a CUDA-graph capture only with the buffers the eager warm-up made (zeroed counters made in a
        # capture would be zeroed only by its replays)
        if triton_fused_ops.silu_lora_a_ready(gate, a) or not torch.cuda.is_current_stream_capturing():
            return triton_fused_ops.silu_mul_lora_a(gate, up, a)
    return silu_mul(gate, up, act_fn), None


def _rope_store_fits(q, k, v, cos, sin, k_cache, v_cache, slot) -> bool:
    """The fused decode kernel applies: CUDA 16-bit tensors of one dtype, the layouts it takes."""
    tensors = (q, k, v, cos, sin, k_cache, v_cache)
    return (use_triton(q) and all(t.dtype == q.dtype and t.device == q.device for t in tensors)
            and slot.device == q.device and slot.dtype == torch.int64 and slot.numel() in (1, q.shape[0])
            and q.shape[1] == 1 and all(t.stride(-1) == 1 for t in tensors)
            and sin.stride() == cos.stride() and v_cache.stride() == k_cache.stride())


def rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """One decode token: q [B, 1, H, hd], k, v [B, 1, KV, hd]; cos, sin [B, 1, hd]; one layer's caches
    k_cache, v_cache [B, KV, max_len, hd]; slot a 0-d int64 tensor on the caches' device, or int64 [B] (a
    slot per row: each row writes its own slot).

    Returns rope(q) [B, 1, H, hd] (a new tensor; q is not written); writes rope(k) into k_cache[:, :, slot]
    and v into v_cache[:, :, slot]. slot is only read on the device (no sync), so the call can be captured
    in a CUDA graph and replayed with new slot values. Same result as `rope_reference` on q and k followed
    by an `index_copy_` of the slot; the Triton path (CUDA bf16/fp16, one dtype throughout) does it in one launch.
    """
    if _rope_store_fits(q, k, v, cos, sin, k_cache, v_cache, slot):
        from .triton.fused_ops import rope_store_decode

        return rope_store_decode(q, k, v, cos, sin, k_cache, v_cache, slot)
    rq = rope_reference(q, cos, sin)
    if slot.numel() == 1:
        k_cache.index_copy_(2, slot.view(1), rope_reference(k, cos, sin).transpose(1, 2))
        v_cache.index_copy_(2, slot.view(1), v.transpose(1, 2))
    else:  # row b writes slot[b]
        rows = torch.arange(q.shape[0], device=slot.device)
        k_cache[rows, :, slot] = rope_reference(k, cos, sin)[:, 0]
        v_cache[rows, :, slot] = v[:, 0]
    return rq
