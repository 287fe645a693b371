"""A static key/value cache: allocated once per (rows, length), written in place, never reallocated.

Static addresses are what lets a CUDA graph replay the decode step: the graph reads and writes the same
buffers every time. Each row holds one sequence from slot 0: its prompt in slots [0, Lp), then one slot per
generated token, so every row has its own decode slot (the engine's `step_slot [B]`). A row attends to the
slots up to its own; a slot past a row's prompt that still holds an older sequence's (or a prefill pad's)
values is always rewritten before that row's slot reaches it. `rows(b)` is the cache of the first b rows
(views of the same memory): the decode step of a narrower batch after compaction.
"""

import torch


class KVCache:
    """Per layer k and v, each [B, n_kv_heads, max_len, head_dim] in `dtype`, plus `key_valid`.

    key_valid [B, max_len] bool, all True: every slot a query can see (at or before its row's slot) holds a
    real token, so the attention kernels' validity mask never hides anything here; it is kept because those
    kernels take one.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.key_valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.batch, self.max_len = batch, max_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def rows(self, b: int) -> "KVCache":
        """The first b rows, as views (same memory, same addresses on every call)."""
        if b == self.batch:
            return self
        view = KVCache.__new__(KVCache)
        view.k, view.v = [t[:b] for t in self.k], [t[:b] for t in self.v]
        view.key_valid, view.batch, view.max_len = self.key_valid[:b], b, self.max_len
        return view

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy slots [0, length) of rows src into rows dst (int64 [n] each, on the cache's device);
        src and dst may overlap (compaction): the source rows are read before any is written."""
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]


class PrefillWriter:
    """Where a prefill's k/v go: the forward runs on U distinct prompts, and prompt src[j] fills cache row
    dst[j] (int64 [R] each; a prompt shared by a group is computed once and written to each of its rows)."""

    def __init__(self, cache: KVCache, dst: torch.Tensor, src: torch.Tensor):
        self.cache, self.dst, self.src = cache, dst, src

    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [U, n_kv, L, hd] for slots 0..L-1 of the U prompts."""
        L = k.shape[2]
        self.cache.k[layer][self.dst, :, :L] = k[self.src]
        self.cache.v[layer][self.dst, :, :L] = v[self.src]
