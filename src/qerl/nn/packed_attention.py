"""Packed attention: the attention of qerl's padding-free loss passes (`qerl.rl.packing` plans the micro-batches),
registered in transformers' AttentionInterface as "qerl_packed".

A packed stream holds, per prompt group, the prompt's real tokens once, then each row's loss tokens; positions
restart per group. A prompt token attends causally within its prompt; a completion token attends to its group's
whole prompt and causally to its own completion, never to a sibling or another group. Each "segment" (a prompt,
or a row's completion) gathers its keys [prefix ; own tokens] from the packed K/V into a padded
[S, H, Lk, hd] view and runs one `scaled_dot_product_attention` with a boolean mask per bucket of
similar-sized segments (`packed_layout`), then the outputs are put back in packed order. Padding thus exists
only inside attention, never in the linear layers, and every query sees at least key 0 (no fully masked
softmax row). The shared prompt's gradient is the sum over its group's completions, as with G copies.
Attention sinks (gpt-oss's per-head `s_aux` logits) enter as one extra zero key whose mask entry is the sink
(`with_sink_column`); logit softcapping is refused. A layout built with attention="flex" holds no buckets: the
stream is attended in place by FlexAttention (`packed_flex`, the same rule as a block mask).

The implementation is selected on the model's config for the packed forward only and restored after it
(`packed_attention`); gradient checkpointing replays each decoder layer in the backward, after that restore,
so the packed forward also hands torch's checkpoint a `context_fn` that selects it again around the replay
(`replay_packed`). `Gather` / `host_gather`: row gathers whose backward is a gather too.
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from ..choices import PACKED_ATTENTION
from .packed_flex import FlexLayout, flex_layout, flex_packed_forward
from .sinks import with_sink_column

ATTN_NAME = "qerl_packed"
# SDPA backends for the masked, padded segments. Not cuDNN: its backward gave non-finite LoRA gradients on packed
# micro-batches where these two give finite ones that agree with the padded path (docs/training.md, "Packed loss
# passes")
MASKED_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class Gather:
    """A row gather along one dim whose backward is a gather too.

    index int64 [M]: the source position of each output row; inverse int64 [size, D]: the output rows that
    read each source position, padded with M (`inverse_index`). Autograd's own backward of an index is a
    sort-based scatter-add, redone in every layer of every micro-batch (a third of a 1.5B model's loss pass
    on an H100); the layout is fixed per micro-batch, so its inverse is built once on the host.
    """

    index: torch.Tensor
    inverse: torch.Tensor

    def __call__(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return _GatherRows.apply(x, dim, self.index, self.inverse)


def inverse_index(index: torch.Tensor, size: int, read: torch.Tensor | None = None) -> torch.Tensor:
    """index int64 [M] (values in [0, size)) -> int64 [size, D]: per source position the output rows m with
    index[m] == it and read[m] (default all), in increasing m, padded with M; D = the most rows reading one
    position (at least 1). Rows left out by `read` get no gradient: only leave out rows whose gradient is
    exactly zero (masked keys, padded queries)."""
    rows = index.numel()
    m = torch.arange(rows)
    if read is not None:
        index, m = index[read], m[read]
    order = torch.argsort(index, stable=True)
    sorted_index = index[order]
    counts = torch.bincount(sorted_index, minlength=size)
    depth = max(int(counts.max()) if counts.numel() else 1, 1)
    rank = torch.arange(sorted_index.numel()) - (torch.cumsum(counts, 0) - counts)[sorted_index]
    inverse = torch.full((size, depth), rows, dtype=torch.long)
    inverse[sorted_index, rank] = m[order]
    return inverse


def host_gather(index: torch.Tensor, size: int, device, read: torch.Tensor | None = None) -> Gather:
    """A `Gather` built from a host index (see `inverse_index`), both tensors moved to `device`."""
    inverse = inverse_index(index, size, read)
    return Gather(index.to(device, non_blocking=True), inverse.to(device, non_blocking=True))


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, index, inverse):
        ctx.dim = dim
        ctx.save_for_backward(inverse)
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        dim = ctx.dim % grad.dim()
        zero = grad.new_zeros(*grad.shape[:dim], 1, *grad.shape[dim + 1:])
        picked = torch.cat([grad, zero], dim).index_select(dim, inverse.reshape(-1))
        size, depth = inverse.shape
        picked = picked.view(*grad.shape[:dim], size, depth, *grad.shape[dim + 1:])
        if depth == 1:
            return picked.squeeze(dim + 1), None, None, None
        acc = torch.promote_types(grad.dtype, torch.float32)  # bf16 readers summed in fp32
        return picked.sum(dim + 1, dtype=acc).to(grad.dtype), None, None, None


LAYOUT_KWARG = "qerl_packing"  # the forward kwarg that carries a PackedLayout down to the attention


@dataclass
class _Bucket:
    """Segments of similar size attended in one padded SDPA call (S segments, all tensors on the device).

    q_index int64 [S, Lq]: packed position of each query (0 where padded); k_index int64 [S, Lk]: packed
    position of each key, prefix first (0 where padded); q_pos int64 [S, 1]: the number of prefix keys
    (query i sits at sequence position q_pos + i); k_len int64 [S, 1]: real keys; take: the real queries
    among the flat [S * Lq], in the order `PackedLayout.order` refers to. queries / keys: the gathers of
    q_index / k_index (flattened) from the packed stream.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    q_pos: torch.Tensor
    k_len: torch.Tensor
    take: Gather
    queries: Gather
    keys: Gather
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """bool [S, 1, Lq, Lk]: key j is visible to query i iff j <= prefix + i (causal, prompt included) and,
        with a sliding window, prefix + i - j < window (HF's rule). Padded queries copy the segment's last
        real query, so every row sees at least itself: no fully masked softmax row, no NaN. Built once per
        window and reused by every layer and the checkpoint recompute (it is ~8 kernel launches)."""
        if sliding_window not in self._masks:
            self._masks[sliding_window] = self._build_mask(sliding_window)
        return self._masks[sliding_window]

    def _build_mask(self, sliding_window: int | None) -> torch.Tensor:
        Lq, Lk = self.q_index.shape[1], self.k_index.shape[1]
        i = torch.arange(Lq, device=self.q_index.device).view(1, Lq, 1)
        j = torch.arange(Lk, device=self.q_index.device).view(1, 1, Lk)
        q = torch.minimum(self.q_pos.view(-1, 1, 1) + i, self.k_len.view(-1, 1, 1) - 1)
        m = j <= q
        if sliding_window is not None:
            m &= q - j < sliding_window
        return m.unsqueeze(1)


@dataclass
class PackedLayout:
    """Who attends to whom in one packed stream of L tokens: buckets of segments, and `order`, the
    permutation (a gather of [L]) that puts the buckets' concatenated real query outputs back in packed order;
    or, for the FlexAttention form (`packed_flex`), `flex` and no buckets."""

    buckets: list[_Bucket]
    order: Gather | None
    flex: FlexLayout | None = None


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """transformers attention interface: query [1, H, L, hd], key / value [1, KV, L, hd] (RoPE applied) ->
    ([1, L, H, hd], None). The layout comes in `kwargs[LAYOUT_KWARG]`; `attention_mask` is None (no mask
    function is registered for this implementation, so transformers builds none)."""
    layout: PackedLayout = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} needs the `{LAYOUT_KWARG}` forward kwarg")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("packed attention does not support logit softcapping")
    sinks = kwargs.get("s_aux")  # gpt-oss: one learned logit per head in every softmax's denominator
    if layout.flex is not None:
        if sinks is not None or dropout:
            raise NotImplementedError("optim.packed_attention: flex does not take attention sinks or attention "
                                      "dropout; use packed_attention: sdpa for this model")
        return flex_packed_forward(query, key, value, layout.flex, scaling, sliding_window), None
    H, KV = query.shape[1], key.shape[1]
    q, k, v = query[0], key[0], value[0]  # [H or KV, L, hd]
    outs = []
    for b in layout.buckets:
        (S, Lq), Lk = b.q_index.shape, b.k_index.shape[1]
        qb = b.queries(q, 1).view(H, S, Lq, -1).transpose(0, 1)  # [S, H, Lq, hd]
        kb, vb = (_repeat_heads(b.keys(t, 1).view(KV, S, Lk, -1).transpose(0, 1), H // KV)
                  for t in (k, v))  # [S, H, Lk, hd]
        mask = b.mask(sliding_window)
        if sinks is not None:
            qb, kb, vb, mask = with_sink_column(qb, kb, vb, mask, sinks)
        with sdpa_kernel(MASKED_SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=dropout, scale=scaling)
        outs.append(b.take(o.transpose(1, 2).reshape(S * Lq, H, -1)))  # real queries only [n, H, hd]
    out = layout.order(torch.cat(outs))  # packed order [L, H, hd]
    return out.unsqueeze(0), None


def _repeat_heads(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[S, KV, Lk, hd] -> [S, KV * n_rep, Lk, hd], query head h reading kv head h // n_rep (HF's repeat_kv)."""
    if n_rep == 1:
        return t
    S, KV, Lk, hd = t.shape
    return t[:, :, None].expand(S, KV, n_rep, Lk, hd).reshape(S, KV * n_rep, Lk, hd)


AttentionInterface.register(ATTN_NAME, packed_attention_forward)  # a new name: nothing existing is replaced


@contextmanager
def packed_attention(model):
    """Inside, every config in `model` selects the packed attention; the previous implementations are
    restored on exit, exceptions included."""
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation")}
    previous = {key: c._attn_implementation for key, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = ATTN_NAME
        yield
    finally:
        for key, c in configs.items():
            c._attn_implementation = previous[key]


@contextmanager
def replay_packed(model):
    """Make gradient-checkpointed layers recompute, in the backward, under the packed attention too.

    transformers' checkpointed layers call `module._gradient_checkpointing_func(forward, *args)`, a
    `partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, ...)`; adding a `context_fn` whose
    recompute context is `packed_attention(model)` makes the replay see the same implementation as the
    forward. Only the forward's checkpoints capture it: the attribute is restored on exit."""
    layers = [m for m in model.modules()
              if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]
    saved = [m._gradient_checkpointing_func for m in layers]
    context_fn = lambda: (nullcontext(), packed_attention(model))  # noqa: E731 (forward ctx, recompute ctx)
    try:
        for m, f in zip(layers, saved):
            m._gradient_checkpointing_func = partial(f, context_fn=context_fn)
        yield
    finally:
        for m, f in zip(layers, saved):
            m._gradient_checkpointing_func = f


def packed_layout(segments: list[tuple[int, int, int, int]], device, attention: str = "sdpa") -> PackedLayout:
    """The attention layout of one packed stream of segments (prefix start, prefix length, own start, own length).
    attention "sdpa": buckets of segments, largest first; a segment joins the open bucket while the padded area
    stays within twice the real area, so padding inside attention is bounded and the number of SDPA calls stays
    small (about log2 of the length range). "flex": the stream attended in place by FlexAttention
    (`packed_flex`)."""
    if attention not in PACKED_ATTENTION:
        raise ValueError(f"unknown packed attention {attention!r}; choose one of {PACKED_ATTENTION}")
    if attention == "flex":
        return PackedLayout([], None, flex_layout(segments, device))
    buckets, current, lq, lk, area = [], [], 0, 0, 0
    for s in sorted(segments, key=lambda s: (s[3], s[1] + s[3]), reverse=True):
        q, k = s[3], s[1] + s[3]
        if current and (len(current) + 1) * lq * max(lk, k) > 2 * (area + q * k):  # lq: the first (largest)
            buckets.append(current)
            current, lk, area = [], 0, 0
        if not current:
            lq = q
        current.append(s)
        lk, area = max(lk, k), area + q * k
    if current:
        buckets.append(current)
    size = sum(s[3] for s in segments)  # the stream's length: every token is one segment's own
    made, order = [], []
    for bucket in buckets:
        pre_start, pre_len, start, length = (torch.tensor(c, dtype=torch.long).unsqueeze(1) for c in zip(*bucket))
        Lq, Lk = int(length.max()), -(-int((pre_len + length).max()) // 16) * 16  # mask rows 16-aligned (CUDA SDPA)
        i, j = torch.arange(Lq).unsqueeze(0), torch.arange(Lk).unsqueeze(0)
        real_q = i < length
        q_index = torch.where(real_q, start + i, 0)
        k_index = torch.where(j < pre_len, pre_start + j, torch.where(j < pre_len + length, start + j - pre_len, 0))
        real_k = j < pre_len + length
        take = real_q.reshape(-1).nonzero().squeeze(1)
        order.append(q_index[real_q])
        made.append(_Bucket(*(t.to(device, non_blocking=True) for t in (q_index, k_index, pre_len, pre_len + length)),
                            take=host_gather(take, real_q.numel(), device),
                            # padded queries and masked keys get exactly zero gradient: left out of the inverse
                            queries=host_gather(q_index.reshape(-1), size, device, real_q.reshape(-1)),
                            keys=host_gather(k_index.reshape(-1), size, device, real_k.reshape(-1))))
    order = torch.argsort(torch.cat(order)) if order else torch.zeros(0, dtype=torch.long)
    return PackedLayout(made, host_gather(order, order.numel(), device))
