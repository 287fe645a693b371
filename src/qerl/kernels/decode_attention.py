"""Decode-step attention of the rollout engine: one query token per row over a layer's static KV cache.

  decode_attention(q, k_cache, v_cache, key_valid, slot, S, scale, sinks=None, window=None) -> out [B, H, hd]
  rope_store_decode_attention(q, k, v, cos, sin, k_cache, v_cache, ...) -> out [B, H, hd]: the same after RoPE on
      q and k and this token's k/v written at the slot (`fused_ops.rope_qk_store`), in the attention's own launch

Row b attends to cache slots j < S with key_valid[b, j] and j <= slot (slot: 0-d int64 device tensor, or int64 [B]
with a slot per row; on the device, so a captured CUDA graph can be replayed with new values), and, with a sliding
`window` (gpt-oss), slot - j < window: the distance in slots is the distance in positions, as a row's tokens occupy
consecutive slots (left pads, if any, only hide keys through key_valid). `sinks` [H] (gpt-oss): one logit per query
head that joins the softmax's denominator and has no value (transformers' eager gpt-oss attention, `qerl.nn.sinks`);
it is not multiplied by `scale`. GQA follows HF's repeat_kv: query head h reads kv head h // (H // KV). On CUDA
bf16/fp16 (and QERL_DISABLE_TRITON unset) it is a flash-decoding Triton kernel (`triton.decode_attention`: one
launch, or two when the visible span is split across programs and `FUSED_COMBINE` is off) in place of SDPA plus its
mask kernels; elsewhere the fp32 torch reference below. Both never read masked slots (stale or NaN values there are
harmless) and give zeros for a row with no visible key, with or without a sink.
"""

import torch

from .fused_ops import _rope_store_fits, rope_qk_store
from .route import use_triton

# True: the attention kernel applies RoPE and writes the slot's k/v itself (one launch fewer per layer and step,
# 1-3% of the step; docs/benchmarks.md "Decode step against its floor"); False: `rope_qk_store`'s own launch first
# (the reference the GPU tests compare it with, bit for bit)
FUSED_ROPE_STORE = True
# True: with splits, the last program of each (row, kv head) merges the partials (one launch fewer per layer and
# step, 1-4% of the step: docs/benchmarks.md "Decode step against its floor"); False: the combine pass's own launch
# (the same bits: both sum the splits in split order)
FUSED_COMBINE = True
# True: the engine has the attention kernel also compute the o projection's LoRA A product (`lora_a=`; one launch
# fewer per layer and step). Off: measured 6-9% slower per step than the separate LoRA A launch (same page), with
# the partials then summed one load at a time; the tiled sum is not timed yet
FUSED_LORA_A_O = False


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               key_valid: torch.Tensor, slot: torch.Tensor, S: int, scale: float,
                               sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Same contract as `decode_attention`, in explicit fp32 math; the output is rounded once to q's dtype."""
    B, H, hd = q.shape
    KV = k_cache.shape[1]
    # [B, S]; slot stays on the device
    j = torch.arange(S, device=q.device)
    visible = key_valid[:, :S] & (j <= slot.reshape(-1, 1))
    if window is not None:
        visible = visible & (slot.reshape(-1, 1) - j < window)
    hidden = ~visible[:, None, :, None]  # [B, 1, S, 1]
    k = k_cache[:, :, :S].float().masked_fill(hidden, 0)  # zeroed, not just -inf scores: 0 * NaN is NaN
    v = v_cache[:, :, :S].float().masked_fill(hidden, 0)
    qg = q.float().reshape(B, KV, H // KV, hd)  # heads kv*G .. kv*G + G - 1 share kv head kv
    scores = (qg @ k.transpose(-1, -2)) * scale  # [B, KV, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:  # an extra column holding the head's sink logit, dropped after the softmax
        sink = sinks.float().reshape(1, KV, H // KV, 1).expand(B, KV, H // KV, 1)
        p = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :S]
    else:
        p = torch.softmax(scores, dim=-1)
    p = p.nan_to_num(0.0)  # a row with no visible key: all -inf -> NaN -> zeros (with a sink: p = 0 already)
    return (p @ v).reshape(B, H, hd).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_valid: torch.Tensor,
                     slot: torch.Tensor, S: int, scale: float, sinks: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """q [B, H, hd] bf16/fp16 (unit last stride); k_cache, v_cache [B, KV, max_len, hd] of q's dtype (one
    layer's full cache); key_valid [B, max_len] bool; slot 0-d int64 tensor or int64 [B] (a slot per row) on
    q's device (never read on the host); S (int, slot < S <= max_len): leading slots scanned; scale: score
    multiplier; sinks None or a float [H] tensor on q's device (per-head sink logits, read on the device);
    window None or an int >= 1 (a layer's sliding window, fixed per layer) -> [B, H, hd], q's dtype."""
    if use_triton(q):
        from .triton.decode_attention import decode_attention_triton

        return decode_attention_triton(q, k_cache, v_cache, key_valid, slot, S, scale, sinks=sinks, window=window,
                                       merge=FUSED_COMBINE)
    return decode_attention_reference(q, k_cache, v_cache, key_valid, slot, S, scale, sinks, window)


def rope_store_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                key_valid: torch.Tensor, slot: torch.Tensor, S: int, scale: float,
                                sinks: torch.Tensor | None = None, window: int | None = None,
                                lora_a: torch.Tensor | None = None):
    """One decode token: `rope_qk_store(q, k, v, cos, sin, k_cache, v_cache, slot)` (q [B, 1, H, hd] and k, v
    [B, 1, KV, hd] before RoPE; cos, sin [B, 1, hd]), then `decode_attention` of the rotated q over the caches ->
    out [B, H, hd], q's dtype; the caches hold rope(k) and v at the slot afterwards. On CUDA (one dtype, the
    layouts `rope_qk_store`'s kernel takes) the attention kernel does the rotation and the write itself, one
    launch fewer per layer and step, with the same values. lora_a [R, H * hd] (the o projection's stacked LoRA A):
    returns (out, h) with h = out.reshape(B, H * hd) @ lora_a^T [B, R] in q's dtype, made by the attention kernel
    itself on CUDA (`decode_attention_triton(lora_a=)`), else by `lora_a.lora_a` after it."""
    if FUSED_ROPE_STORE and use_triton(q) and q.shape[-1] % 2 == 0 and \
            _rope_store_fits(q, k, v, cos, sin, k_cache, v_cache, slot):
        from .triton import decode_attention as tda

        fused = lora_a is not None and tda.lora_fits(lora_a, q[:, 0]) and (
            tda.lora_buffers_ready(q.device, q.shape[0], k_cache.shape[1], lora_a.shape[0])
            or not tda.capturing(q.device))  # buffers a capture would make are made by the eager warm-up first
        out = tda.decode_attention_triton(q[:, 0], k_cache, v_cache, key_valid, slot, S, scale, sinks=sinks,
                                          window=window, rope=(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0]),
                                          merge=FUSED_COMBINE, lora_a=lora_a if fused else None)
        if lora_a is None or fused:
            return out
    else:
        q = rope_qk_store(q, k, v, cos, sin, k_cache, v_cache, slot)
        out = decode_attention(q[:, 0], k_cache, v_cache, key_valid, slot, S, scale, sinks=sinks, window=window)
        if lora_a is None:
            return out
    from .lora_a import lora_a as lora_a_product  # a rank, dtype or layout the kernel does not take

    return out, lora_a_product(out.reshape(out.shape[0], -1), lora_a)
