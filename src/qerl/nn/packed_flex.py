"""Packed attention on FlexAttention: the packed stream attended in place, with a block mask, instead of gathered
into padded per-segment views for SDPA (`packed_attention`, the reference).

The rule is the same: a prompt token attends causally within its prompt; a completion token attends to its
group's whole prompt and causally to its own completion (and, with a sliding window, only to keys whose sequence
position is less than the window behind its own). Per stream token the layout keeps where its own segment starts
and which prefix it reads, so the mask is a function of (query, key) positions; FlexAttention skips the blocks
it rules out and computes the rest without padding or gathers, forward and backward.

The block mask is built here, not by `create_block_mask`: compiled (its CUDA path), that compiles a Triton reduction
over each 128 x 128 tile which at a 7B micro-batch's stream (~17k tokens) was still compiling after 100+ s of a
step's first micro-batch (stack dumps, H200); eager, it evaluates the mask over the whole stream x stream at once.
`FlexLayout.block_mask` evaluates the same `mask_mod` a few thousand query rows at a time and counts each tile's
visible pairs: a tile with none is skipped, a full one runs unmasked, the rest apply the mask inside the kernel.

Selected by `optim.packed_attention: flex`. Not for attention sinks, logit softcapping or attention dropout
(those models keep the SDPA form). FlexAttention's backward runs on CUDA only; on other devices the forward runs
unfused (PyTorch's reference), which is what the CPU tests use.
"""

import functools
import warnings
from dataclasses import dataclass, field

import torch

BLOCK = 128  # FlexAttention's sparse block: its kernels' default tile
MASK_CHUNK_ELEMENTS = 1 << 26  # (query, key) pairs evaluated at once while the block mask is built (64 MiB of bool)


def _kv_blocks(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [nq, nk] tiles -> (count int32 [1, 1, nq], indices int32 [1, 1, nq, nk]): per query block the number of
    its tiles and their key-block indices, ascending, first (the rest of the row is whatever follows)."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


@dataclass
class FlexLayout:
    """Per token of a packed stream of L tokens (int32 [L] each, on the device): own_start, the stream position
    where its segment begins; prefix_start / prefix_len, the prefix it also reads (its group's prompt; length 0
    for a prompt token); position, its sequence position (prefix_len + its index in its segment)."""

    own_start: torch.Tensor
    prefix_start: torch.Tensor
    prefix_len: torch.Tensor
    position: torch.Tensor
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def length(self) -> int:
        return self.own_start.numel()

    def block_mask(self, sliding_window: int | None, block: int = BLOCK):
        """The FlexAttention block mask of the stream (built once per window and block size, reused by every layer
        and the checkpoint recompute)."""
        key = (sliding_window, block)
        if key not in self._masks:
            from torch.nn.attention.flex_attention import BlockMask

            partial, full = self.block_tiles(sliding_window, block)
            self._masks[key] = BlockMask.from_kv_blocks(
                *_kv_blocks(partial), *_kv_blocks(full), BLOCK_SIZE=block, mask_mod=self.mask_mod(sliding_window),
                seq_lengths=(self.length, self.length))
        return self._masks[key]

    def block_tiles(self, sliding_window: int | None, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        """Which block x block tiles of the stream's (query, key) square hold some visible pairs but not all
        (partial) and which hold only visible ones (full): two bool [nb, nb], nb = ceil(L / block). Tiles past the
        stream's end count their missing pairs as hidden (so an edge tile is never full), as create_block_mask does."""
        L, device = self.length, self.own_start.device
        nb = -(-L // block)
        visible = self.mask_mod(sliding_window)
        keys = torch.arange(L, device=device)[None, :]
        partial = torch.zeros(nb, nb, dtype=torch.bool, device=device)
        full = torch.zeros_like(partial)
        rows = max(1, MASK_CHUNK_ELEMENTS // max(L, 1) // block)  # query blocks per chunk
        for b0 in range(0, nb, rows):
            b1 = min(nb, b0 + rows)
            queries = torch.arange(b0 * block, min(b1 * block, L), device=device)[:, None]
            m = torch.zeros((b1 - b0) * block, nb * block, dtype=torch.bool, device=device)
            m[:queries.shape[0], :L] = visible(0, 0, queries, keys)
            counts = m.view(b1 - b0, block, nb, block).sum((1, 3))
            partial[b0:b1] = (counts > 0) & (counts < block * block)
            full[b0:b1] = counts == block * block
        return partial, full

    def mask_mod(self, sliding_window: int | None):
        own, pre, pre_len, pos = self.own_start, self.prefix_start, self.prefix_len, self.position

        def visible(b, h, q, k):
            m = ((k >= own[q]) & (k <= q)) | ((k >= pre[q]) & (k < pre[q] + pre_len[q]))
            if sliding_window is not None:
                m = m & (pos[q] - pos[k] < sliding_window)
            return m

        return visible


def flex_layout(segments: list[tuple[int, int, int, int]], device) -> FlexLayout:
    """The FlexLayout of a stream of segments (prefix start, prefix length, own start, own length), as
    `packed_attention.packed_layout` takes them; every stream token is exactly one segment's own."""
    if not segments:
        empty = torch.zeros(0, dtype=torch.int32)
        return FlexLayout(*(empty.to(device) for _ in range(4)))
    size = max(s + n for _, _, s, n in segments)
    own = torch.full((size,), -1, dtype=torch.int32)
    prefix = torch.zeros(size, dtype=torch.int32)
    prefix_len = torch.zeros(size, dtype=torch.int32)
    position = torch.zeros(size, dtype=torch.int32)
    for ps, pl, s, n in segments:
        if bool((own[s:s + n] >= 0).any()):
            raise ValueError(f"segments overlap at stream positions {s}..{s + n - 1}")
        own[s:s + n] = s
        prefix[s:s + n] = ps
        prefix_len[s:s + n] = pl
        position[s:s + n] = torch.arange(pl, pl + n, dtype=torch.int32)
    if bool((own < 0).any()):
        raise ValueError("segments must cover the stream: every token one segment's own")
    return FlexLayout(*(t.to(device, non_blocking=True) for t in (own, prefix, prefix_len, position)))


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (its fused kernels, forward and backward). Dynamic from the first
    call: every micro-batch has its own stream length and block count, and a static compile would recompile for
    the second and third lengths it meets (forward and backward each) before turning dynamic."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def flex_packed_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: FlexLayout,
                        scaling: float | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """query [1, H, L, hd], key / value [1, KV, L, hd] (RoPE applied, KV dividing H) -> [1, L, H, hd]."""
    if query.shape[2] != layout.length:
        raise ValueError(f"the stream has {query.shape[2]} tokens, its layout {layout.length}")
    block_mask = layout.block_mask(sliding_window)
    gqa = query.shape[1] != key.shape[1]
    if query.is_cuda:
        return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scaling,
                                enable_gqa=gqa).transpose(1, 2)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise NotImplementedError("optim.packed_attention: flex trains on CUDA only (FlexAttention has no backward "
                                  f"on {query.device.type}); use packed_attention: sdpa")
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # the unfused reference is what a forward off CUDA is meant to run
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = flex_attention(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)
