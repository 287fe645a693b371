"""Rotary position embedding tables from a HF config: cos and sin for every position the cache can hold,
computed once per engine (the decode step indexes them by position, so a CUDA graph reads fixed addresses)."""

import torch


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """inv_freq [hd/2] fp32 and the cos/sin scale, from `rope_parameters` (transformers 5) or `rope_theta`.

    Default RoPE is computed here exactly as HF does (same fp32 ops, so the same bits); scaled variants
    (llama3, yarn, linear, ...) use transformers' own init functions; dynamic ones change with the sequence
    length at run time, which a static cache cannot follow, so they are refused.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope_type {rope_type!r} changes with sequence length; not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rope_tables(config, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, hd] in dtype for positions 0..max_len-1 (HF layout: the two halves repeat)."""
    inv_freq, scale = rope_inv_freq(config)
    freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype).to(device), (emb.sin() * scale).to(dtype).to(device)
