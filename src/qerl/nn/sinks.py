"""Attention sinks (gpt-oss): one learned logit per query head that joins every softmax's denominator and
contributes no value, expressed as inputs to torch's `scaled_dot_product_attention`.

transformers' eager gpt-oss attention appends the head's sink logit to each row of scores, takes the softmax,
and drops that column. Appending a key of zeros (score q . 0 * scale = 0) whose additive mask entry is the
sink logit, with a value of zeros, gives the same probabilities over the real keys and the same output, and
lets any SDPA backend that takes a float mask run it (the packed loss pass, the rollout engine's attention).
"""

import torch

SINK_PAD = 16  # key columns added for the sink: 1 used, the rest masked, so Lk stays 16-aligned for CUDA SDPA


def with_sink_column(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor):
    """q [B, H, Lq, hd], k / v [B, H, Lk, hd] (heads already repeated to H), bool mask broadcastable to
    [B, H, Lq, Lk] (True = attend), sinks [H] -> (q, k and v with SINK_PAD zero rows appended along the keys,
    float mask [B, H, Lq, Lk + SINK_PAD] in q's dtype: 0 where attended, -inf where not, the head's sink
    logit in the first added column, -inf in the others). Every row then attends at least the sink."""
    B, H, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    pad = k.new_zeros(B, H, SINK_PAD, k.shape[-1])
    k, v = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
    neg = q.new_full((), float("-inf"))  # a device fill, not a host copy: CUDA-graph capturable
    scores = torch.where(mask, torch.zeros((), dtype=q.dtype, device=q.device), neg).expand(B, H, Lq, Lk)
    extra = torch.cat([sinks.to(q.dtype).view(1, H, 1, 1).expand(B, H, Lq, 1),
                       neg.expand(B, H, Lq, SINK_PAD - 1)], -1)
    return q, k, v, torch.cat([scores, extra], -1)
