"""Which sequence decodes in which cache row: the static and the continuous scheduler of `RolloutEngine`.

A generate call's sequences form a queue, in order. The engine decodes `width` rows (a batch bucket, one
captured CUDA graph per bucket and attended length), one token per row per step; every `check_every` steps
(and when every row has surely stopped) the host reads which rows finished.

- static (the reference): a pass takes the next `width` sequences and decodes until every one of them has
  stopped; finished rows stay in the batch, computed and masked. Then the next pass.
- continuous (the default): a finished row is refilled from the queue at the next check, its prompt
  prefilled into the row. Once the queue is empty, the survivors are compacted into the first rows of the
  cache whenever a bucket of at most half the current width holds them (not below `MIN_COMPACT_WIDTH`
  rows), and decoding continues at that width.

Both prefill a distinct prompt once: sequences with the same prompt (a GRPO group) are one prefill row, its
k/v written into each of their cache rows; a group split over two refills copies the k/v from a row that
still holds it. Random draws follow (seed, sequence, position) only (`sampling.draw_key`), so a sequence
draws the same tokens from the same logits under either scheduler, in any row or batch.

Per-step records (token, mask, log-prob, entropy) go to chunk buffers [rows, check_every], one per interval
between checks; a sequence's tokens are gathered from them at the end, following the rows it occupied.
"""

from collections import deque
from dataclasses import dataclass, field

import torch

from ..choices import SCHEDULERS  # the engine's schedulers (and the config's rollout.scheduler)
from .memory import BATCH_BUCKETS, bucket_batch
from .sampling import draw_key, keyed_exponentials, next_token
from .stop_strings import decode_text

# Compaction moves the live rows to the smallest batch bucket that holds them, never below MIN_COMPACT_WIDTH rows,
# and only when that halves the width: each new width costs one decode-graph capture, per rollout where the
# trainer frees the graphs before its backward (rollout.release_kv_cache true, data parallel), which a 7B step at
# GSM8K lengths did not win back below about 8 rows or with 3 x 2^k widths in between (docs/benchmarks.md, "One RL
# step on real completion lengths", the 14-width build); and below 8 rows a 7B decode step is no faster (its
# weights dominate what it reads), so narrower widths would only lower the row-steps count
MIN_COMPACT_WIDTH = 8
COMPACT_WIDTHS = tuple(b for b in BATCH_BUCKETS if b >= MIN_COMPACT_WIDTH)


def compact_width(n: int) -> int:
    """The width compaction gives n live rows: their batch bucket, at least MIN_COMPACT_WIDTH."""
    return bucket_batch(max(n, MIN_COMPACT_WIDTH))


@dataclass
class Sequence:
    """One completion to draw. index: its row in the result; group: sequences with an identical prompt share
    one (its prefill is computed once); budget: the most tokens it may generate."""

    index: int
    prompt: list[int]
    group: int
    budget: int
    start: int = -1  # the decode step of its first token
    length: int = 0  # tokens generated (set when it finishes)
    rows: dict[int, int] = field(default_factory=dict)  # chunk -> cache row it occupied in that chunk


def make_sequences(prompts: list[list[int]], budgets: list[int]) -> list[Sequence]:
    """Sequences in prompt order; identical prompts get one group (wherever they are in the list)."""
    groups: dict[tuple, int] = {}
    return [Sequence(i, p, groups.setdefault(tuple(p), len(groups)), b)
            for i, (p, b) in enumerate(zip(prompts, budgets))]


class Records:
    """Per-step records of the rows in chunks: chunk c covers decode steps [starts[c], starts[c] + C)."""

    def __init__(self, rows: int, C: int, pad_id: int, device):
        self.rows, self.C, self.pad_id, self.device = rows, C, pad_id, device
        self.tokens, self.mask, self.logprobs, self.entropies, self.starts = [], [], [], [], []

    def open(self, start: int) -> None:
        """A new chunk from decode step `start`."""
        R, C, dev = self.rows, self.C, self.device
        self.tokens.append(torch.full((R, C), self.pad_id, dtype=torch.int64, device=dev))
        self.mask.append(torch.zeros(R, C, dtype=torch.bool, device=dev))
        self.logprobs.append(torch.zeros(R, C, dtype=torch.float32, device=dev))
        self.entropies.append(torch.zeros(R, C, dtype=torch.float32, device=dev))
        self.starts.append(start)

    @property
    def chunk(self) -> int:
        return len(self.starts) - 1

    def column(self, g: int, b: int):
        """The current chunk's columns of step g for rows [:b]: tokens, mask, logprobs, entropies."""
        j = g - self.starts[-1]
        return tuple(t[-1][:b, j] for t in (self.tokens, self.mask, self.logprobs, self.entropies))

    def gather(self, seqs: list[Sequence], lengths: list[int]):
        """Tokens [n, L] int64, mask [n, L] bool, logprobs and entropies [n, L] fp32 (L = max(lengths, 1))
        of the first lengths[i] tokens of seqs[i], read from the chunks it occupied."""
        n, width = len(seqs), max(max(lengths, default=0), 1)
        flat, dst = [], []
        for i, (s, length) in enumerate(zip(seqs, lengths)):
            for c, row in s.rows.items():
                lo = max(s.start, self.starts[c]) - s.start
                hi = min(s.start + length, self.starts[c] + self.C) - s.start
                if hi > lo:
                    base = (c * self.rows + row) * self.C + s.start - self.starts[c]
                    flat.append(torch.arange(base + lo, base + hi))
                    dst.append(torch.arange(i * width + lo, i * width + hi))
        out = [torch.full((n * width,), self.pad_id, dtype=torch.int64), torch.zeros(n * width, dtype=torch.bool),
               torch.zeros(n * width), torch.zeros(n * width)]
        out = [t.to(self.device) for t in out]
        if flat:
            src, dst_i = torch.cat(flat).to(self.device), torch.cat(dst).to(self.device)
            for o, chunks in zip(out, (self.tokens, self.mask, self.logprobs, self.entropies)):
                o[dst_i] = torch.stack(chunks).view(-1)[src]
        return tuple(o.view(n, width) for o in out)


class Scheduler:
    """One generate call's decode loop over `engine` (a `RolloutEngine` set up for `width` rows).

    The engine provides the forward passes and the static step buffers; this class decides which sequence
    runs in which row and keeps the per-row state: on the host `rows` (the sequence of each row) and on the
    device done [W] bool, row_len [W] int64 (tokens generated), budget [W] int64 and keys [W] int64 (draw
    counters), plus the engine's slot_base / slot_lo (each row's decode slot is max(slot_base + step,
    slot_lo): the prompt length at the row's first decode step, one more at each step after).
    """

    def __init__(self, engine, seqs: list[Sequence], width: int, mode: str, sampling, seed: int, stop, eos_ids,
                 aqn, fused: bool):
        if mode not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {mode!r}; choose one of {SCHEDULERS}")
        self.e, self.mode, self.sampling, self.seed, self.stop, self.aqn, self.fused = (
            engine, mode, sampling, seed, stop, aqn, fused)
        self.queue = deque(seqs)
        self.W = bucket_batch(width)
        self.width = width
        dev = engine.device
        self.dev = dev
        self.rows: list[Sequence | None] = [None] * self.W
        self.done = torch.ones(self.W, dtype=torch.bool, device=dev)
        self.row_len = torch.zeros(self.W, dtype=torch.int64, device=dev)
        self.budget = torch.ones(self.W, dtype=torch.int64, device=dev)
        self.keys = torch.zeros(self.W, dtype=torch.int64, device=dev)
        self.host_keys = [0] * self.W
        self.eos = torch.tensor(eos_ids, dtype=torch.int64, device=dev)
        self.records = Records(self.W, engine.check_every, engine.pad_token_id, dev)
        self.group_logits: dict[int, torch.Tensor] = {}  # prefill logits [V] of groups with members queued
        self.pending = None  # (rows, logits): the first-token logits of rows placed at the last check
        self.stats = {"decoded_row_steps": 0, "prefill_tokens": 0, "prefill_rows": 0}

    # placing sequences into rows ------------------------------------------------------------------

    def place(self, seqs: list[Sequence], rows: list[int], start: int) -> None:
        """Put seqs into cache rows `rows`, their first token to be drawn at step `start`: k/v of each
        prompt (prefilled once per group, or copied from a row that holds it), row state, first logits."""
        targets = set(rows)
        holders = {s.group: b for b, s in enumerate(self.rows) if s is not None and b not in targets}
        copy_src, copy_dst, fresh, fresh_rows = [], [], {}, []
        for s, b in zip(seqs, rows):
            if s.group in holders and s.group in self.group_logits:
                copy_src.append(holders[s.group])
                copy_dst.append(b)
            else:
                fresh.setdefault(s.group, s.prompt)
                fresh_rows.append((b, list(fresh).index(s.group)))
        if copy_src:
            length = max(len(self.rows[b].prompt) for b in copy_src)
            self.e.cache.move_rows(*(torch.tensor(x, device=self.dev) for x in (copy_src, copy_dst)), length)
        logits = {}
        if fresh:
            if self.aqn is not None and self.aqn.per_forward and start > 0:  # at 0 the entry draw is still fresh
                self.aqn.resample()
            dst, src = zip(*fresh_rows)
            out = self.e.prefill(list(fresh.values()), torch.tensor(dst, device=self.dev),
                                 torch.tensor(src, device=self.dev))
            self.stats["prefill_tokens"] += len(fresh) * max(map(len, fresh.values()))
            self.stats["prefill_rows"] += len(fresh)
            logits = dict(zip(fresh, out))
        queued = {s.group for s in self.queue}
        for g, lg in logits.items():
            if g in queued:
                self.group_logits[g] = lg
        first = torch.stack([logits[s.group] if s.group in logits else self.group_logits[s.group] for s in seqs])
        for g in list(self.group_logits):
            if g not in queued:
                del self.group_logits[g]

        idx = torch.tensor(rows, device=self.dev)
        lengths = [len(s.prompt) for s in seqs]
        host = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.dev)  # noqa: E731
        self.e.slot_base[idx] = host([n - start - 1 for n in lengths])
        self.e.slot_lo[idx] = host(lengths)
        self.done[idx] = False
        self.row_len[idx] = 0
        self.budget[idx] = host([s.budget for s in seqs])
        keys = [draw_key(s.index, start) for s in seqs]
        self.keys[idx] = host(keys)
        for s, b, k in zip(seqs, rows, keys):
            s.start = start
            self.rows[b] = s
            self.host_keys[b] = k
        self.pending = (idx, first)

    def _clear_rows(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) hold no sequence: finished, masked, decoding at slot_lo."""
        self.done[lo:hi] = True
        self.e.slot_base[lo:hi] = 0
        self.e.slot_lo[lo:hi] = 0

    # the loop ---------------------------------------------------------------------------------------

    def run(self) -> dict[str, int]:
        """Decode every sequence to its end; returns the work counts (`Rollout.stats` without kept_tokens)."""
        e = self.e
        self._clear_rows(0, self.W)
        first = [self.queue.popleft() for _ in range(min(self.width, len(self.queue)))]
        b = bucket_batch(len(first))
        self.place(first, list(range(len(first))), 0)
        self._refresh_limits(b)
        g, decode = 0, False
        self.records.open(0)
        while True:
            if decode:
                if self.aqn is not None and self.aqn.per_forward:
                    self.aqn.resample()
                e.step_index.fill_(g)
                e.decode(b, self._kv_len(g))
            if self.pending is not None:  # the placed rows' first logits come from their prefill
                rows, logits = self.pending
                e.step_logits.index_copy_(0, rows, logits.to(e.step_logits.dtype))
                self.pending = None
            self._sample(g, b)
            self.stats["decoded_row_steps"] += b
            if g + 1 - self.records.starts[-1] < self.records.C and g < self._done_by:
                g, decode = g + 1, True
                continue
            # a check: one host read of every row's state
            self._check(b)
            if self.mode == "static":
                if not any(s is not None for s in self.rows[:b]):
                    if not self.queue:
                        break
                    nxt = [self.queue.popleft() for _ in range(min(self.width, len(self.queue)))]
                    self._clear_rows(0, self.W)
                    b = bucket_batch(len(nxt))
                    self.place(nxt, list(range(len(nxt))), g + 1)
            else:
                free = [r for r in range(min(b, self.width)) if self.rows[r] is None]
                if self.queue and free:
                    nxt = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
                    self.place(nxt, free[:len(nxt)], g + 1)
                elif not any(s is not None for s in self.rows[:b]):
                    break
                elif not self.queue:
                    b = self._compact(b, g)
            # rows placed at this check draw their first token from their prefill: a decode step is only
            # needed when other rows are still running
            self._refresh_limits(b)
            placed = 0 if self.pending is None else len(self.pending[0])
            g, decode = g + 1, sum(s is not None for s in self.rows[:b]) > placed
            self.records.open(g)
        return self.stats

    def _sample(self, g: int, b: int) -> None:
        """Draw step g's token for rows [:b] from step_logits and record it (masked for done rows); then
        count it and mark rows that reached their budget done."""
        e = self.e
        tok_col, mask_col, lp_col, ent_col = self.records.column(g, b)
        logits = e.step_logits[:b]
        if self.fused:
            from ..kernels.triton.sampling import sample_triton

            sample_triton(logits, self.sampling.temperature, self.seed, g, row_keys=self.keys[:b], record=dict(
                done=self.done[:b], eos=self.eos, pad_id=e.pad_token_id, tokens=tok_col, mask=mask_col,
                logprobs=lp_col, entropies=ent_col, step_tokens=e.step_tokens[:b]))
        else:
            draws = keyed_exponentials(self.seed, self.host_keys[:b], g)
            tok, lp, ent = next_token(logits, self.sampling, None, draws)
            alive = ~self.done[:b]
            tok_col.copy_(torch.where(alive, tok, e.pad_token_id))
            mask_col.copy_(alive)
            lp_col.copy_(lp * alive)
            ent_col.copy_(ent * alive)
            self.done[:b] |= torch.isin(tok, self.eos)
            e.step_tokens[:b].copy_(tok)
        self.row_len[:b] += mask_col
        self.done[:b] |= self.row_len[:b] >= self.budget[:b]

    def _refresh_limits(self, b: int) -> None:
        """Host summaries of rows [:b], which change only at checks: the step by which every row has reached
        its budget, and the largest prompt length and slot offset (a row's slot at step g is
        max(prompt length, prompt length + g - start - 1))."""
        live = [s for s in self.rows[:b] if s is not None]
        self._done_by = max((s.start + s.budget - 1 for s in live), default=0)
        self._top_lo = max((len(s.prompt) for s in live), default=0)
        self._top_base = max((len(s.prompt) - s.start - 1 for s in live), default=0)

    def _kv_len(self, g: int) -> int:
        """Attended cache length of the decode step at g: past every live row's slot (`RolloutEngine.attended_len`)."""
        return self.e.attended_len(max(self._top_lo, self._top_base + g))

    def _check(self, b: int) -> None:
        """Read the rows' state; stop-string rows are marked done; finished sequences leave their rows."""
        c = self.records.chunk
        for r, s in enumerate(self.rows[:b]):
            if s is not None:
                s.rows[c] = r
        state = (self.row_len[:b] * 2 + self.done[:b]).tolist()  # one host copy
        lengths, done = [v // 2 for v in state], [bool(v & 1) for v in state]
        if self.stop:
            live = [r for r in range(b) if self.rows[r] is not None and not done[r]]
            if live:
                toks, mask, _, _ = self.records.gather([self.rows[r] for r in live], [lengths[r] for r in live])
                for r, t, m in zip(live, toks.cpu(), mask.cpu()):
                    if any(x in decode_text(self.e.tokenizer, t[m].tolist()) for x in self.stop):
                        done[r] = True
                        self.done[r] = True
        for r in range(b):
            s = self.rows[r]
            if s is not None and done[r]:
                s.length = lengths[r]
                self.rows[r] = None

    def _compact(self, b: int, g: int) -> int:
        """Move the live rows of [:b] to the front when a compaction width of at most b / 2 holds them;
        returns the new width."""
        live = [r for r in range(b) if self.rows[r] is not None]
        nb = compact_width(len(live))
        if 2 * nb > b:
            return b
        e = self.e
        src = torch.tensor(live, device=self.dev)
        dst = torch.arange(len(live), device=self.dev)
        in_use = min(max(self._top_lo, self._top_base + g + 1) + 1, e.max_seq_len)  # slots any live row has written
        e.cache.move_rows(src, dst, in_use)
        for t in (self.done, self.row_len, self.budget, self.keys, e.step_tokens, e.slot_base, e.slot_lo):
            t[dst] = t[src]
        seqs = [self.rows[r] for r in live]
        self.rows = seqs + [None] * (self.W - len(seqs))
        self.host_keys = [self.host_keys[r] for r in live] + [0] * (self.W - len(live))
        self._clear_rows(len(live), self.W)
        return nb
