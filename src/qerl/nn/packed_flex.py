"""Packed attention on FlexAttention: the packed stream attended in place, with a block mask, instead of gathered
into padded per-segment views for SDPA (`packed_attention`, the reference).

The rule is the same: a prompt token attends causally within its prompt; a completion token attends to its
group's whole prompt and causally to its own completion (and, with a sliding window, only to keys whose sequence
position is less than the window behind its own). Per stream token the layout keeps where its own segment starts
and which prefix it reads, so the mask is a function of (query, key) positions; FlexAttention skips the blocks
it rules out and computes the rest without padding or gathers, forward and backward.

Selected by `optim.packed_attention: flex`. Not for attention sinks, logit softcapping or attention dropout
(those models keep the SDPA form). FlexAttention's backward runs on CUDA only; on other devices the forward runs
unfused (PyTorch's reference), which is what the CPU tests use.
"""

import functools
import warnings
from dataclasses import dataclass, field

import torch

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

    def block_mask(self, sliding_window: int | None):
        """The FlexAttention block mask of the stream (built once per window, reused by every layer and the
        checkpoint recompute)."""
        if sliding_window not in self._masks:
            from torch.nn.attention.flex_attention import create_block_mask

            device = self.own_start.device
            self._masks[sliding_window] = create_block_mask(
                self.mask_mod(sliding_window), None, None, self.length, self.length, device=device,
                _compile=device.type == "cuda")
        return self._masks[sliding_window]

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
