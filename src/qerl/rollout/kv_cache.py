"""A static key/value cache: allocated once per (batch, length), written in place, never reallocated.

Static addresses are what lets a CUDA graph replay the decode step: the graph reads and writes the same
buffers every time. All sequences of a batch share the cache column index ("slot"): prompts are
left-padded, so slot t of every row is written at the same step, and a per-row key mask hides the pads.
"""

import torch


class KVCache:
    """Per layer k and v, each [B, n_kv_heads, max_len, head_dim] in `dtype`, plus `key_valid`.

    key_valid [B, max_len] bool: slot j of row b holds a real token (not a left pad). Slots at or past the
    current decode position are masked separately by the step (causality), so key_valid only marks pads.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.batch, self.max_len = batch, max_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self, pad_len: torch.Tensor) -> None:
        """Start a new batch whose row b has pad_len[b] left pads ([B] int64, on the cache's device).
        Old k/v values need no clearing: every slot a query can see is rewritten before it is read."""
        slots = torch.arange(self.max_len, device=self.key_valid.device)
        self.key_valid.copy_(slots[None, :] >= pad_len[:, None])

    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, n_kv, L, hd] for slots 0..L-1."""
        L = k.shape[2]
        self.k[layer][:, :, :L].copy_(k)
        self.v[layer][:, :, :L].copy_(v)
