"""The rollout engine: batched sampling from the policy the trainer is optimizing, same module objects,
LoRA never merged. Read top to bottom: `prefill` fills cache rows from prompts, `decode` feeds one token
per row, `generate` builds the sequences and hands them to a scheduler (`scheduler`: which sequence runs in
which row; continuous batching by default, the static reference on request), then assembles the result.

The pieces it ties together, one file each: the forward pass over the model's own modules
(`model_runner`, with `rope` and the adapter snapshot `lora_snapshot`), the static KV cache (`kv_cache`),
the captured decode steps (`cuda_graphs`), how many rows a batch may hold (`memory`), turning logits into
tokens (`sampling`; on CUDA one Triton launch per step draws the tokens and records them,
`qerl.kernels.triton.sampling`), stop strings (`stop_strings`) and the result type (`result`). On Hopper
and newer the decode step's kernels are chained by programmatic dependent launch (`qerl.kernels.pdl`):
each launches while its predecessor runs and prefetches its static weight bytes before waiting for the
activations.

Shapes: B rows (a batch bucket), P prompt length, T new tokens, S cache length, V vocabulary. Each cache row
holds one sequence from slot 0 and decodes at its own slot (`step_slot [B]`).
"""

import warnings
from typing import Sequence

import torch
from torch import nn

from ..kernels import dequantized_weights
from ..kernels.route import use_triton
from ..kernels.pdl import programmatic_launches
from . import memory
from .cuda_graphs import DecodeGraphs
from .kv_cache import KVCache, PrefillWriter
from .memory import bucket_batch, round_up
from .model_runner import CausalLMRunner
from .result import Rollout
from .sampling import SamplingParams, fused_sampling_applies, philox_seed
from .scheduler import COMPACT_WIDTHS, SCHEDULERS, Scheduler, make_sequences
from .stop_strings import cut_at_stop_strings, finish_reasons

__all__ = ["Rollout", "RolloutEngine", "bucket_batch"]


class RolloutEngine:
    """Batched sampler over `model` (a HF causal LM, possibly with QuantLinear layers from qerl).

    max_seq_len bounds prompt + completion and sizes the KV cache. scheduler: "continuous" (default) refills
    a finished row from the queue of sequences and compacts the survivors into smaller buckets once the
    queue is empty; "static" (the reference) decodes passes of rows until each pass's last row stops
    (`scheduler`). Either way a distinct prompt is prefilled once for all its rows. cuda_graphs (default: on
    for CUDA models; off, with a warning, for mixture-of-experts models, whose routing syncs with the host)
    captures one decode step per (batch bucket, attended cache length); the attended
    length grows in blocks of kv_block slots, so early steps do not read the whole cache. The batch width:
    at most `max_batch` rows, or on CUDA by default as many as the KV cache and step buffers of
    `memory_fraction` of the free memory hold. fuse_siblings (default: on for CUDA models) stores each
    q/k/v and gate/up group of quantized linears back to back, once, so each group decodes as one matmul
    (`qerl.models.siblings`: same memory, the modules keep working alone). pdl (default on; used on sm_90+
    GPUs, off with QERL_PDL=0): the decode step's Triton kernels launch with programmatic dependent launch,
    each starting while the previous one finishes (`qerl.kernels.pdl`). fused_sampling (default on; CUDA, no
    top-k / top-p): each step's draw, log-prob, entropy and bookkeeping in one Triton launch
    (`qerl.kernels.triton.sampling`) instead of ~24 small torch ops. Draws are counter-based: token p of
    sequence s uses the counter (seed, s, p), the seed taken once per call from the generator, so a seeded
    run repeats itself under either scheduler; the fused and the eager sampler use different streams.
    dense_weights: a dict the caller keeps (the trainer's model.dense_weights store): quantized linears then
    decode with a 16-bit copy of each weight, made once and kept there (`kernels.dequant_cache`).
    """

    def __init__(self, model: nn.Module, tokenizer=None, max_seq_len: int = 2048, cuda_graphs: bool | None = None,
                 kv_block: int = 256, pad_token_id: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                 check_every: int = 16, max_batch: int | None = None, memory_fraction: float = 0.85,
                 fuse_siblings: bool | None = None, pdl: bool = True, fused_sampling: bool = True,
                 scheduler: str = "continuous", dense_weights: dict | None = None):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {SCHEDULERS}")
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.runner = CausalLMRunner(model, max_seq_len, fuse_siblings=fuse_siblings)
        self.model, self.tokenizer = model, tokenizer
        self.device = self.runner.device
        self.max_seq_len = max_seq_len
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        if self.runner.has_moe and not self.runner.moe_capturable and self.cuda_graphs:
            warnings.warn("rollout engine: this model's MoE experts route tokens on the host (16-bit experts, NF4, "
                          "the per-expert reference path, or expert LoRA without torch._grouped_mm), so it decodes "
                          "eagerly, without CUDA graphs",
                          stacklevel=2)
            self.cuda_graphs = False
        self.pdl = pdl
        self.fused_sampling = fused_sampling
        self.scheduler = scheduler
        self.dense_weights = dense_weights
        self.kv_block = kv_block
        self.check_every = check_every
        self.max_batch, self.memory_fraction = max_batch, memory_fraction
        self.pad_token_id = _first_not_none(pad_token_id, getattr(tokenizer, "pad_token_id", None),
                                            getattr(model.config, "pad_token_id", None), 0)
        eos = _first_not_none(eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                              getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None))
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.cache: KVCache | None = None
        self.decode_graphs = DecodeGraphs()
        self._graph_sig = None

    @property
    def graphs(self) -> dict[tuple[int, int], "torch.cuda.CUDAGraph"]:
        """The captured decode steps, keyed by (batch bucket, attended cache length)."""
        return self.decode_graphs.graphs

    # setup ----------------------------------------------------------------------------------------

    def _setup(self, batch: int) -> None:
        """Allocate the cache and static step buffers for `batch` rows (a bucket; kept while it suffices:
        a narrower batch decodes in the first rows)."""
        if self.cache is not None and self.cache.batch >= batch:
            return
        self.cache = None  # free first: the old cache may be most of the free memory
        self.decode_graphs.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        r, dev = self.runner, self.device
        self.cache = KVCache(len(r.layers), batch, r.n_kv, r.head_dim, self.max_seq_len, r.dtype, dev)
        # static inputs / outputs of the decode step (fixed addresses for graph replay); row b decodes at
        # slot max(slot_base[b] + step_index, slot_lo[b]) (clamped into the cache), see `decode_one_token`
        self.step_tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.step_index = torch.zeros((), dtype=torch.int64, device=dev)
        self.slot_base = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.slot_lo = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.step_slot = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.slots = torch.arange(self.max_seq_len, device=dev)
        self.step_logits = torch.zeros(batch, self.model.config.vocab_size, dtype=r.dtype, device=dev)

    # the two forward passes -------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]], dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Prefill U distinct prompts (token-id lists) once and write prompt src[j]'s k/v into cache row
        dst[j] (int64 [R] each, on the device), slots 0..len-1 -> logits of each prompt's last token [U, V]
        in the model's dtype. The batch is right-padded: pads sit after the real tokens, so causality alone
        hides them; their k/v land in slots the row rewrites before it can attend to them."""
        U, P = len(prompts), max(map(len, prompts))
        tokens = torch.full((U, P), self.pad_token_id, dtype=torch.int64)
        for j, p in enumerate(prompts):
            tokens[j, :len(p)] = torch.tensor(p, dtype=torch.int64)
        tokens = tokens.to(self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        positions = self.slots[:P].expand(U, P)
        causal = (self.slots[:P][None, :] <= self.slots[:P][:, None])[None, None]  # [1, 1, P(query), P(key)]
        return self.runner.forward(tokens, positions, PrefillWriter(self.cache, dst, src), causal, last=last)

    def decode_one_token(self, b: int, kv_len: int) -> torch.Tensor:
        """Feed step_tokens[:b] (int64) of rows [:b], each at its slot max(slot_base + step_index, slot_lo);
        returns logits [b, V] in the model's dtype (in step_logits[:b]).

        Attends over the first kv_len cache slots; everything it reads and writes is a static buffer (or a
        view of the first b rows of one), so this is exactly what a CUDA graph captures."""
        slot = self.step_slot[:b]
        torch.maximum(self.slot_base[:b] + self.step_index, self.slot_lo[:b], out=slot)
        slot.clamp_(max=self.max_seq_len - 1)  # finished rows keep stepping until the next check
        mask = (self.slots[:kv_len][None, :] <= slot[:, None])[:, None, None]  # [b, 1, 1, kv_len]
        with programmatic_launches(self.device, self.pdl):
            logits = self.runner.forward(self.step_tokens[:b, None], slot[:, None], self.cache.rows(b), mask,
                                         slot=slot)
        self.step_logits[:b].copy_(logits)
        return self.step_logits[:b]

    def attended_len(self, top_slot: int) -> int:
        """Cache slots a decode step scans when no row's slot exceeds top_slot: whole kv_block blocks past it,
        or the whole cache under CUDA graphs with the Triton decode attention, whose programs stop at each
        row's own slot anyway: then one graph per batch bucket serves every length (a capture per bucket
        and block would cost more than the blocks save, most of all when compaction visits many buckets)."""
        if self.cuda_graphs and use_triton(self.step_logits):
            return self.max_seq_len
        return min(round_up(top_slot + 1, self.kv_block), self.max_seq_len)

    def decode(self, b: int, kv_len: int) -> torch.Tensor:
        """decode_one_token(b, kv_len): replayed from its CUDA graph (captured on first use) when cuda_graphs."""
        if not self.cuda_graphs:
            return self.decode_one_token(b, kv_len)
        self.decode_graphs.replay((b, kv_len), lambda: self.decode_one_token(b, kv_len))
        return self.step_logits[:b]

    # generate -------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False,
                 attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                 aqn=None, force_lengths: Sequence[int] | None = None, scheduler: str | None = None) -> Rollout:
        """Sample completions for a batch of prompts.

        prompts: list of token-id lists, or an int tensor [B, L] with `attention_mask` (left or right
        padding, or none). stop: strings that end a completion (checked every `check_every` steps and
        cut exactly afterwards; needs a tokenizer). ignore_eos: force max_new_tokens (benchmarks).
        force_lengths: per prompt, the exact number of tokens to generate (EOS ignored; each at most
        max_new_tokens): benchmarks on real length profiles. aqn: an optional
        `qerl.nn.noisy_norm.NoisyNorms`; applied for this call (and the exact weights restored after)
        unless already active; with per_forward=True its noise is redrawn before every forward pass,
        otherwise one draw serves the whole call. scheduler: overrides the engine's for this call.
        The result's `stats` count the work: decoded_row_steps (rows computed per step, summed),
        kept_tokens (completion tokens returned), prefill_tokens / prefill_rows (prompt tokens and prompts
        prefilled, padding included).
        """
        if aqn is not None and not aqn.active:
            with aqn:
                return self.generate(prompts, max_new_tokens, sampling, seed, stop, ignore_eos, attention_mask,
                                     generator, aqn, force_lengths, scheduler)
        rows = _prompt_rows(prompts, attention_mask)
        if not rows:
            raise ValueError("generate needs at least one prompt")
        if min(map(len, rows)) == 0:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        budgets = [max_new_tokens] * len(rows)
        if force_lengths is not None:
            budgets = [int(n) for n in force_lengths]
            if len(budgets) != len(rows) or not all(1 <= n <= max_new_tokens for n in budgets):
                raise ValueError(f"force_lengths needs one length in [1, max_new_tokens={max_new_tokens}] per "
                                 f"prompt ({len(rows)} prompts, got {len(budgets)} lengths)")
            ignore_eos = True
        P = max(map(len, rows))
        if P + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                             f"({self.max_seq_len}); build the engine with a larger max_seq_len")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if generator is None and seed is not None:
            generator = torch.Generator(self.device).manual_seed(seed)
        width = self.rows_per_pass(len(rows), P + max_new_tokens)
        self._setup(bucket_batch(width))
        self._sync_lora()
        probe = self.step_logits[:1]
        fused = self.fused_sampling and fused_sampling_applies(probe, sampling)
        draw_seed = 2**32 if sampling.greedy else philox_seed(generator, self.device)
        seqs = make_sequences(rows, budgets)
        eos = [] if ignore_eos else self.eos_token_ids
        with self._dense_scope():
            sched = Scheduler(self, seqs, width, scheduler or self.scheduler, sampling, draw_seed, stop, eos,
                              aqn, fused)
            stats = sched.run()
            return self._result(seqs, sched.records, stop, ignore_eos, stats)

    def _result(self, seqs, records, stop, ignore_eos: bool, stats: dict) -> Rollout:
        """The Rollout of finished sequences (in call order) from the scheduler's `records`."""
        tokens, mask, lp, ent = records.gather(seqs, [s.length for s in seqs])
        cut = [False] * len(seqs)
        if stop:
            mask, cut = cut_at_stop_strings(self.tokenizer, tokens, mask, stop)
        tokens = tokens.masked_fill(~mask, self.pad_token_id)
        lp, ent = lp * mask, ent * mask
        finish = finish_reasons(tokens, mask, cut, self.eos_token_ids, ignore_eos)
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(t[m].tolist(), skip_special_tokens=True)
                     for t, m in zip(tokens.cpu(), mask.cpu())]
        P = max(len(s.prompt) for s in seqs)
        prompt_ids = torch.full((len(seqs), P), self.pad_token_id, dtype=torch.int64)
        prompt_mask = torch.zeros(len(seqs), P, dtype=torch.bool)
        for i, s in enumerate(seqs):
            prompt_ids[i, P - len(s.prompt):] = torch.tensor(s.prompt, dtype=torch.int64)
            prompt_mask[i, P - len(s.prompt):] = True
        stats = dict(stats, kept_tokens=int(mask.sum()))
        return Rollout(prompt_ids.to(self.device), prompt_mask.to(self.device), tokens, mask, lp, ent, finish,
                       texts, stats)

    @torch.no_grad()
    def warmup(self, batch: int, max_len: int | None = None) -> None:
        """Capture now every decode graph a batch of up to `batch` rows up to `max_len` slots will need (its
        bucket and the narrower ones compaction moves to), so the first timed or trained rollout does not
        pay for those captures. No-op without CUDA graphs."""
        Bb = bucket_batch(batch)
        self._setup(Bb)
        self._sync_lora()
        if not self.cuda_graphs:
            return
        max_len = max_len or self.max_seq_len
        self.slot_lo.zero_()
        self.step_index.zero_()
        lengths = sorted({self.attended_len(top) for top in range(0, max_len, self.kv_block)})
        with self._dense_scope():
            for b in {Bb, *(x for x in COMPACT_WIDTHS if x <= Bb)}:  # and the narrower widths compaction moves to
                for kv_len in lengths:
                    self.slot_base.fill_(kv_len - 1)
                    self.decode(b, kv_len)

    def _dense_scope(self):
        """Where quantized matmuls use dense weight copies: the caller's `dense_weights` store (kept across
        calls; the captured graphs read its copies, which live as long as the store), else on the CPU a copy
        per weight for this call only, instead of a dequantization per token."""
        if self.dense_weights is not None:
            return dequantized_weights(store=self.dense_weights)
        return dequantized_weights(enabled=self.device.type == "cpu")

    # memory sizing --------------------------------------------------------------------------------

    def rows_per_pass(self, n: int, seq_len: int) -> int:
        """Rows one generate pass may hold: n, or fewer when its batch bucket (what the cache is allocated
        for) exceeds `max_batch` or, by default on CUDA, what `memory_fraction` of the free memory holds.
        seq_len (prompt + new tokens) is only checked against max_seq_len."""
        return memory.rows_per_pass(n, seq_len, self.max_seq_len, self.max_batch, self.memory_fraction,
                                    self._free_bytes, self._bytes_per_row)

    def _bytes_per_row(self) -> int:
        """Memory one batch row needs during generate (`memory.bytes_per_row`)."""
        return memory.bytes_per_row(self.runner, self.max_seq_len, self.model.config.vocab_size)

    def _free_bytes(self) -> int | None:
        """Device memory a new cache may use (`memory.free_bytes`; `_setup` frees the current cache first);
        None off CUDA, where the batch is not split by memory."""
        return memory.free_bytes(self.device, self.cache)

    # helpers --------------------------------------------------------------------------------------

    def _sync_lora(self) -> None:
        """Refresh the adapter snapshot from the trainer's weights; drop graphs if the adapter set changed."""
        lora = self.runner.lora
        sig = (lora.signature(), self.runner.experts_lora_signature())
        if sig != self._graph_sig:
            lora.clear()
            self.decode_graphs.reset()
            self._graph_sig = sig
            # expert LoRA attached since construction may route on the host (no torch._grouped_mm here)
            if self.cuda_graphs and self.runner.has_moe and not self.runner.moe_blocks_capturable():
                warnings.warn("rollout engine: this model's MoE experts now route tokens on the host (expert LoRA "
                              "without torch._grouped_mm), so it decodes eagerly, without CUDA graphs", stacklevel=3)
                self.cuda_graphs = False
        lora.refresh()

    def release_memory(self) -> int:
        """Free the KV cache, the static step buffers and the captured graphs (returns the cache bytes
        freed), e.g. before the training backward needs the memory; the next `generate` allocates and
        captures them again (one graph capture per attended-length block: about 1-3% of a long rollout)."""
        freed = self.cache.nbytes() if self.cache is not None else 0
        self.cache = None
        self.decode_graphs.reset()
        for name in ("step_tokens", "step_index", "slot_base", "slot_lo", "step_slot", "slots", "step_logits"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def invalidate_graphs(self) -> None:
        """Call after replacing (not updating in place) any parameter or buffer the model reads."""
        self.decode_graphs.reset()
        self.runner.lora.clear()


def _first_not_none(*xs):
    return next((x for x in xs if x is not None), None)


def _prompt_rows(prompts, attention_mask) -> list[list[int]]:
    """Prompts as lists of real token ids (pads removed, whichever side they were on)."""
    if isinstance(prompts, torch.Tensor):
        ids = prompts.cpu()
        if ids.ndim == 1:
            ids = ids[None]
        m = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.cpu().bool()
        return [r[k].tolist() for r, k in zip(ids, m)]
    rows = [list(map(int, p)) for p in prompts]
    if not rows:
        raise ValueError("no prompts")
    return rows
