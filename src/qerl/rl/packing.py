"""Padding-free loss passes: token-budget micro-batches in which each group's prompt is forwarded once.

The rows of one step's experience are prompts x G, a group's completions adjacent. A packed micro-batch
is a contiguous row range flattened into one stream without padding: per prompt group present in it, the
prompt's real tokens once, then each row's loss tokens (the first `completion_mask.sum()` of the row; a
row whose mask is all False contributes nothing and gets log-prob 0). Positions restart per group: the
prompt at 0..Lp-1, every completion at Lp.. -- exactly the padded path's position ids.

The attention over such a stream is `qerl.nn.packed_attention` (a prompt token attends within its prompt, a
completion token to its group's prompt and causally to itself); this module plans the micro-batches, lays
each out for it, and computes their log-probs.
"""

from dataclasses import dataclass

import torch

from ..nn.packed_attention import (LAYOUT_KWARG, Gather, PackedLayout, host_gather, packed_attention, packed_layout,
                                   replay_packed)
from ..rollout.sampling import logprob_temperature
from .logprobs import chunked_token_logprobs


@dataclass
class PackedMicroBatch:
    """One packed forward over the rows `rows` of the experience (tensors on the experience's device).

    input_ids / position_ids int64 [L]: the packed stream; layout: its attention; pred: the gather of the
    stream positions whose hidden states predict the loss tokens ([n], row-major over (row, j));
    target_index int64 [n]: where that token sits in `completion_ids.flatten()`; out_index int64 [n]: its
    place in the flat [rows, T] log-prob output. computed_tokens: L (each prompt once per micro-batch it
    appears in); needed_tokens: loss tokens + the prompt of each group whose first loss token is here (each
    distinct prompt once per group), so the sums over a pass compare the two. segments: the stream's runs on
    the host, (prefix, length) each: a prompt (0, its length), a row's loss tokens (the prompt's length, their
    number), for counting the attention's work (`qerl.rl.flops`).
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
    segments: tuple[tuple[int, int], ...] = ()


# token_budget: activation bytes a micro-batch may take with checkpointing (about 4 x layers x hidden bytes a
# token), the floor and the ceiling beyond which a 1.5B step gains nothing (the measurement: docs/training.md,
# "Packed loss passes")
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
                       completion_mask: torch.Tensor, max_tokens: int,
                       attention: str = "sdpa") -> list[PackedMicroBatch]:
    """Cut rows into contiguous ranges of at most `max_tokens` packed tokens and lay each out.

    prompt_ids / prompt_mask [N, P] (left-padded; any padding works), completion_ids [N, T], completion_mask
    [N, T] bool, the loss mask: a prefix of True per row (checked) or all False. A range's tokens are its
    groups' prompts (once per range) plus its loss tokens; a group may be split over ranges (its prompt is
    then repeated); one row over the budget gets a range of its own. Host work: one copy of the masks and
    prompts to the host, index lists built there. attention: the layouts' form (`packed_layout`).
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
    return [rows.lay_out(a, b, counted, attention) for a, b in ranges]


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

    def lay_out(self, a: int, b: int, counted: set[int], attention: str = "sdpa") -> PackedMicroBatch:
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
        layout = packed_layout(segments, self.device, attention)
        return PackedMicroBatch(slice(a, b), ids, dev(pos), layout, pred_gather, dev(target), dev(out), len(src),
                                needed, tuple((p, n) for _, p, _, n in segments))


def packed_logprobs(model, mb: PackedMicroBatch, completion_ids: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
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
    with packed_attention(model), replay_packed(model):
        hidden = model.model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False,
                             **{LAYOUT_KWARG: mb.layout}).last_hidden_state[0]
    h = mb.pred(hidden)
    targets = completion_ids.reshape(-1)[mb.target_index]
    logp = chunked_token_logprobs(h[None], model.lm_head.weight, targets[None], logprob_temperature(temperature))[0]
    return torch.zeros(n_rows * T, dtype=logp.dtype, device=device).index_copy(0, mb.out_index, logp).view(n_rows, T)
