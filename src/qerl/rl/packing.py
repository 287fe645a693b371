"""Padding-free loss passes: token-budget micro-batches in which each group's prompt is forwarded once.

The rows of one step's experience are prompts x G, a group's completions adjacent. A packed micro-batch
is a contiguous row range flattened into one stream without padding: per prompt group present in it, the
prompt's real tokens once, then each row's loss tokens (the first `completion_mask.sum()` of the row; a
row whose mask is all False contributes nothing and gets log-prob 0). Positions restart per group: the
prompt at 0..Lp-1, every completion at Lp.. -- exactly the padded path's position ids.

Attention (`packed_attention_forward`, registered in transformers' AttentionInterface as "qerl_packed"):
a prompt token attends causally within its prompt; a completion token attends to its group's whole
prompt and causally to its own completion, never to a sibling or another group. Each "segment" (a prompt,
or a row's completion) gathers its keys [prefix ; own tokens] from the packed K/V into a padded
[S, H, Lk, hd] view and runs one `scaled_dot_product_attention` with a boolean mask per bucket of
similar-sized segments, then the outputs are put back in packed order. Padding thus exists only inside
attention, never in the linear layers, and every query sees at least key 0 (no fully masked softmax row).
The shared prompt's gradient is the sum over its group's completions, as with G copies. Attention sinks
(gpt-oss's per-head `s_aux` logits) enter as one extra zero key whose mask entry is the sink
(`with_sink_column`); logit softcapping is refused.

The implementation is selected on the model's config for the packed forward only and restored after it;
gradient checkpointing replays each decoder layer in the backward, after that restore, so the packed
forward also hands torch's checkpoint a `context_fn` that selects it again around the replay.
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from ..nn.sinks import with_sink_column
from ..rollout.sampling import logprob_temperature
from .logprobs import chunked_token_logprobs

ATTN_NAME = "qerl_packed"
# SDPA backends for the masked, padded segments. Not cuDNN: on an H200 (torch 2.11, bf16, 2026-11-26) its
# backward gave non-finite LoRA gradients for a 1.5B model's packed micro-batches of ~500-token segments, where
# the memory-efficient and math backends give finite ones that agree with the padded path (fp32: 1.6e-4)
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
    permutation (a gather of [L]) that puts the buckets' concatenated real query outputs back in packed order."""

    buckets: list[_Bucket]
    order: Gather


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
def _replay_packed(model):
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


@dataclass
class PackedMicroBatch:
    """One packed forward over the rows `rows` of the experience (tensors on the experience's device).

    input_ids / position_ids int64 [L]: the packed stream; layout: its attention; pred: the gather of the
    stream positions whose hidden states predict the loss tokens ([n], row-major over (row, j));
    target_index int64 [n]: where that token sits in `completion_ids.flatten()`; out_index int64 [n]: its
    place in the flat [rows, T] log-prob output. computed_tokens: L (each prompt once per micro-batch it
    appears in); needed_tokens: loss tokens + the prompt of each group whose first loss token is here (each
    distinct prompt once per group), so the sums over a pass compare the two.
    """

    rows: slice
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: PackedLayout
    pred: Gather
    target_index: torch.Tensor
    out_index: torch.Tensor
    computed_tokens: int
    needed_tokens: int


# token_budget: activation bytes a micro-batch may take with checkpointing (about 4 x layers x hidden bytes a
# token), the floor (the budget before it was sized by model) and the ceiling beyond which a 1.5B step gains
# nothing (random 1.5B-shaped bf16 LoRA, H100, GSM8K lengths: loss pass 3.51 s at 8192 tokens, 2.26 s at
# 16384, 2.23 s at 32768)
ACTIVATION_BUDGET_BYTES = 6 * 2**30
MIN_TOKEN_BUDGET, MAX_TOKEN_BUDGET = 8192, 16384


def token_budget(config) -> int:
    """Default tokens per packed micro-batch for an HF config: fewer, larger passes cost less host time (each
    pass launches the same number of kernels), bounded so the checkpointed activations stay near 6 GiB;
    a multiple of 1024 in [8192, 16384]."""
    per_token = 4 * config.num_hidden_layers * config.hidden_size
    tokens = ACTIVATION_BUDGET_BYTES // per_token // 1024 * 1024
    return int(min(max(tokens, MIN_TOKEN_BUDGET), MAX_TOKEN_BUDGET))


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[int]:
    """Group id per row [N]: consecutive rows whose real prompt tokens are identical share one id."""
    ids, mask = prompt_ids.cpu(), prompt_mask.cpu().bool()
    groups, last = [], None
    for r in range(ids.shape[0]):
        tokens = ids[r][mask[r]]
        if last is None or not torch.equal(tokens, last):
            groups.append(groups[-1] + 1 if groups else 0)
        else:
            groups.append(groups[-1])
        last = tokens
    return groups


def needed_tokens(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> int:
    """Tokens a loss pass needs: the loss tokens plus each prompt group's prompt once (groups with at least
    one loss token). prompt_ids / prompt_mask [N, P], completion_mask [N, T] bool. One host sync."""
    lc = completion_mask.sum(1).tolist()
    lp = prompt_mask.sum(1).tolist()
    first = {}
    for r, g in enumerate(prompt_groups(prompt_ids, prompt_mask)):
        if lc[r]:
            first.setdefault(g, lp[r])
    return int(sum(lc)) + sum(first.values())


def plan_micro_batches(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                       completion_mask: torch.Tensor, max_tokens: int) -> list[PackedMicroBatch]:
    """Cut rows into contiguous ranges of at most `max_tokens` packed tokens and lay each out.

    prompt_ids / prompt_mask [N, P] (left-padded; any padding works), completion_ids [N, T], completion_mask
    [N, T] bool, the loss mask: a prefix of True per row (checked) or all False. A range's tokens are its
    groups' prompts (once per range) plus its loss tokens; a group may be split over ranges (its prompt is
    then repeated); one row over the budget gets a range of its own. Host work: one copy of the masks and
    prompts to the host, index lists built there.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    rows = _Rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
    ranges, start, tokens, present = [], 0, 0, set()
    for r in range(rows.n):
        cost = rows.lc[r] + (rows.lp(r) if rows.lc[r] and rows.group[r] not in present else 0)
        if cost and tokens and tokens + cost > max_tokens:  # a row without loss tokens never opens one
            ranges.append((start, r))
            start, tokens, present = r, 0, set()
            cost = rows.lc[r] + (rows.lp(r) if rows.lc[r] else 0)
        if rows.lc[r]:
            present.add(rows.group[r])
            tokens += cost
    if rows.n:
        ranges.append((start, rows.n))
    counted: set[int] = set()  # groups whose prompt was already counted as needed
    return [rows.lay_out(a, b, counted) for a, b in ranges]


class _Rows:
    """Host-side view of the experience's rows for planning: loss lengths, prompt columns, prompt groups."""

    def __init__(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        self.n, self.P = prompt_ids.shape
        self.T = completion_ids.shape[1]
        cmask = completion_mask.cpu().bool()
        lc = cmask.sum(1)
        if not torch.equal(cmask, torch.arange(self.T) < lc[:, None]):
            raise ValueError("completion_mask must be a prefix of True per row (or all False) to be packed")
        self.lc: list[int] = lc.tolist()
        pmask = prompt_mask.cpu().bool()
        self.prompt_cols = [pmask[r].nonzero().squeeze(1) for r in range(self.n)]
        self.group = prompt_groups(prompt_ids, pmask)
        if any(n and not len(c) for n, c in zip(self.lc, self.prompt_cols)):
            raise ValueError("a row with loss tokens has an empty prompt: its first token has no predecessor")
        # every stream token is gathered from one flat tensor: prompts first, then completions
        self.flat = torch.cat([prompt_ids.reshape(-1), completion_ids.reshape(-1).to(prompt_ids.dtype)])
        self.device = completion_ids.device

    def lp(self, r: int) -> int:
        return len(self.prompt_cols[r])

    def lay_out(self, a: int, b: int, counted: set[int]) -> PackedMicroBatch:
        """The packed stream of rows a..b-1: per group its prompt, then its rows' loss tokens."""
        P, T = self.P, self.T
        src, pos, segments = [], [], []  # src: index into self.flat per stream token
        pred, target, out = [], [], []
        needed, prompt_start, current = 0, 0, None
        for r in range(a, b):
            n = self.lc[r]
            if not n:
                continue
            Lp = self.lp(r)
            if self.group[r] != current:  # the group's prompt, once in this micro-batch
                current, prompt_start = self.group[r], len(src)
                src += (r * P + self.prompt_cols[r]).tolist()
                pos += range(Lp)
                segments.append((prompt_start, 0, prompt_start, Lp))  # (prefix start, prefix len, start, len)
                if current not in counted:
                    counted.add(current)
                    needed += Lp
            start = len(src)
            src += range(self.n * P + r * T, self.n * P + r * T + n)
            pos += range(Lp, Lp + n)
            segments.append((prompt_start, Lp, start, n))
            pred += [prompt_start + Lp - 1, *range(start, start + n - 1)]  # token j is predicted at j - 1
            target += range(r * T, r * T + n)
            out += range((r - a) * T, (r - a) * T + n)
            needed += n
        dev = lambda x: torch.tensor(x, dtype=torch.long).to(self.device, non_blocking=True)  # noqa: E731
        ids = self.flat[dev(src)] if src else self.flat[:0]
        pred_gather = host_gather(torch.tensor(pred, dtype=torch.long), len(src), self.device)
        return PackedMicroBatch(slice(a, b), ids, dev(pos), _layout(segments, self.device), pred_gather,
                                dev(target), dev(out), len(src), needed)


def _layout(segments: list[tuple[int, int, int, int]], device) -> PackedLayout:
    """Buckets of segments (prefix start, prefix length, own start, own length), largest first; a segment
    joins the open bucket while the padded area stays within twice the real area, so padding inside
    attention is bounded and the number of SDPA calls stays small (about log2 of the length range)."""
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


def packed_logprobs(model, mb: PackedMicroBatch, completion_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(completion token | prefix) of the rows `mb.rows`, fp32 [rows, T] (0 where masked): the same
    values and layout as `completion_logprobs` on those rows, from one packed forward.

    completion_ids [N, T]: the whole experience's (mb indexes into it). temperature: the sampling
    temperature (0 = greedy), log-probs under softmax(logits / logprob_temperature(temperature)).
    """
    T = completion_ids.shape[1]
    n_rows = mb.rows.stop - mb.rows.start
    device = completion_ids.device
    if not mb.computed_tokens:  # every row masked: nothing to forward
        return torch.zeros(n_rows, T, dtype=torch.float32, device=device)
    with packed_attention(model), _replay_packed(model):
        hidden = model.model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False,
                             **{LAYOUT_KWARG: mb.layout}).last_hidden_state[0]
    h = mb.pred(hidden)
    targets = completion_ids.reshape(-1)[mb.target_index]
    logp = chunked_token_logprobs(h[None], model.lm_head.weight, targets[None], logprob_temperature(temperature))[0]
    return torch.zeros(n_rows * T, dtype=logp.dtype, device=device).index_copy(0, mb.out_index, logp).view(n_rows, T)
