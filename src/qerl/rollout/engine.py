"""The rollout engine: batched sampling from the policy the trainer is optimizing, same module objects,
LoRA never merged. Read top to bottom: `prefill` fills the KV cache from the prompts, `decode_one_token`
feeds one token per row, `generate` loops them and records what was sampled.

The pieces it ties together, one file each: the forward pass over the model's own modules
(`model_runner`, with `rope` and the adapter snapshot `lora_snapshot`), the static KV cache (`kv_cache`),
the captured decode steps (`cuda_graphs`), how many rows a pass may hold (`memory`), turning logits into
tokens (`sampling`; on CUDA one Triton launch per step draws the tokens and records them,
`qerl.kernels.triton_sampling`), stop strings (`stop_strings`) and the result type (`result`). On Hopper
and newer the decode step's kernels are chained by programmatic dependent launch (`qerl.kernels.pdl`):
each launches while its predecessor runs and prefetches its static weight bytes before waiting for the
activations.

Shapes: B batch (padded up to a bucket), P prompt length (left-padded), T new tokens, S cache length,
V vocabulary.
"""

from typing import Sequence

import torch
from torch import nn

from ..kernels import dequantized_weights
from ..kernels.pdl import programmatic_launches
from . import memory
from .cuda_graphs import DecodeGraphs
from .kv_cache import KVCache
from .memory import bucket_batch, round_up
from .model_runner import CausalLMRunner
from .result import Rollout
from .sampling import SamplingParams, fused_sampling_applies, next_token, philox_seed
from .stop_strings import cut_at_stop_strings, finish_reasons, stop_string_rows

__all__ = ["Rollout", "RolloutEngine", "bucket_batch"]


class RolloutEngine:
    """Batched sampler over `model` (a HF causal LM, possibly with QuantLinear layers from qerl).

    max_seq_len bounds prompt + completion and sizes the KV cache. cuda_graphs (default: on for CUDA
    models) captures one decode step per (batch bucket, attended cache length); the attended length grows
    in blocks of kv_block slots, so early steps do not read the whole cache. A batch larger than what
    fits runs as several passes: at most `max_batch` rows per pass, or on CUDA by default as many as the
    KV cache and step buffers of `memory_fraction` of the free memory hold. fuse_siblings (default: on
    for CUDA models) stores each q/k/v and gate/up group of quantized linears back to back, once, so each
    group decodes as one matmul (`qerl.models.siblings`: same memory, the modules keep working alone).
    pdl (default on; used on sm_90+ GPUs, off with QERL_PDL=0): the decode step's Triton kernels launch
    with programmatic dependent launch, each starting while the previous one finishes (`qerl.kernels.pdl`).
    fused_sampling (default on; CUDA, no top-k / top-p): each step's draw, log-prob, entropy and bookkeeping
    in one Triton launch (`qerl.kernels.triton_sampling`) instead of ~24 small torch ops. Same distribution
    and statistics; the draws come from a counter-based stream seeded once per call from the generator, so
    a seeded run repeats itself but does not match the eager sampler token for token.
    """

    def __init__(self, model: nn.Module, tokenizer=None, max_seq_len: int = 2048, cuda_graphs: bool | None = None,
                 kv_block: int = 256, pad_token_id: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                 check_every: int = 32, max_batch: int | None = None, memory_fraction: float = 0.85,
                 fuse_siblings: bool | None = None, pdl: bool = True, fused_sampling: bool = True):
        self.runner = CausalLMRunner(model, max_seq_len, fuse_siblings=fuse_siblings)
        self.model, self.tokenizer = model, tokenizer
        self.device = self.runner.device
        self.max_seq_len = max_seq_len
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self.pdl = pdl
        self.fused_sampling = fused_sampling
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
        """Allocate the cache and static step buffers for a batch bucket (once per bucket change)."""
        if self.cache is not None and self.cache.batch == batch:
            return
        self.cache = None  # free first: the old cache may be most of the free memory
        self.decode_graphs.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        r = self.runner
        self.cache = KVCache(len(r.layers), batch, r.n_kv, r.head_dim, self.max_seq_len, r.dtype, self.device)
        # static inputs / outputs of the decode step (fixed addresses for graph replay)
        self.step_tokens = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.step_slot = torch.zeros((), dtype=torch.int64, device=self.device)
        self.pad_len = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.slots = torch.arange(self.max_seq_len, device=self.device)
        self.step_logits = torch.zeros(batch, self.model.config.vocab_size, dtype=r.dtype, device=self.device)

    # the two forward passes -------------------------------------------------------------------------

    def prefill(self, tokens: torch.Tensor, pad_len: torch.Tensor) -> torch.Tensor:
        """tokens [B, P] int64 left-padded, pad_len [B] int64 -> logits of the last prompt token [B, V] in the
        model's dtype; fills slots < P."""
        B, P = tokens.shape
        self.cache.reset(pad_len)
        positions = (self.slots[:P][None, :] - pad_len[:, None]).clamp_min(0)
        causal = self.slots[:P][None, :] <= self.slots[:P][:, None]  # [P(query), P(key)]
        # pads attend to themselves only: a fully masked softmax row would be nan and leak through v
        mask = (causal[None] & self.cache.key_valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=self.device)
        return self.runner.forward(tokens, positions, self.cache, mask[:, None])

    def decode_one_token(self, kv_len: int) -> torch.Tensor:
        """Feed step_tokens [B] int64 at slot step_slot (0-dim int64); returns logits [B, V] in the model's
        dtype (in step_logits).

        Attends over the first kv_len cache slots; everything it reads and writes is a static buffer, so
        this is exactly what a CUDA graph captures.
        """
        positions = (self.step_slot - self.pad_len)[:, None]  # [B, 1]
        mask = self.cache.key_valid[:, :kv_len] & (self.slots[:kv_len] <= self.step_slot)[None, :]
        with programmatic_launches(self.device, self.pdl):
            logits = self.runner.forward(self.step_tokens[:, None], positions, self.cache, mask[:, None, None],
                                         slot=self.step_slot)
        self.step_logits.copy_(logits)
        return self.step_logits

    def _decode(self, kv_len: int) -> torch.Tensor:
        """decode_one_token(kv_len): replayed from its CUDA graph (captured on first use) when cuda_graphs."""
        if not self.cuda_graphs:
            return self.decode_one_token(kv_len)
        self.decode_graphs.replay((self.cache.batch, kv_len), lambda: self.decode_one_token(kv_len))
        return self.step_logits

    # generate -------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False,
                 attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                 aqn=None) -> Rollout:
        """Sample completions for a batch of prompts.

        prompts: list of token-id lists, or an int tensor [B, L] with `attention_mask` (left or right
        padding, or none). stop: strings that end a completion (checked every `check_every` steps and
        cut exactly afterwards; needs a tokenizer). ignore_eos: force max_new_tokens (benchmarks).
        aqn: an optional `qerl.nn.noisy_norm.NoisyNorms`; applied for this call (and the exact weights
        restored after) unless already active; with per_forward=True its noise is redrawn before every
        forward pass, otherwise one draw serves the whole batch.
        """
        if aqn is not None and not aqn.active:
            with aqn:
                return self.generate(prompts, max_new_tokens, sampling, seed, stop, ignore_eos, attention_mask,
                                     generator, aqn)
        rows = _prompt_rows(prompts, attention_mask)
        if not rows:
            raise ValueError("generate needs at least one prompt")
        if generator is None and seed is not None:
            generator = torch.Generator(self.device).manual_seed(seed)
        per_pass = self.rows_per_pass(len(rows), max(map(len, rows)) + max_new_tokens)
        # CPU: dequantize each weight once for this call instead of once per token (dropped on return).
        with dequantized_weights(enabled=self.device.type == "cpu"):
            parts = [self._generate(rows[i:i + per_pass], max_new_tokens, sampling, stop, ignore_eos, generator, aqn)
                     for i in range(0, len(rows), per_pass)]
        return parts[0] if len(parts) == 1 else Rollout.concat(parts, self.pad_token_id)

    def _generate(self, rows: list[list[int]], max_new_tokens, sampling, stop, ignore_eos, gen, aqn) -> Rollout:
        """One pass over rows (token-id lists, at most what `rows_per_pass` allows): prefill, then one
        `decode_one_token` per new token until max_new_tokens were drawn or every row has stopped (checked
        every `check_every` steps). gen: the torch.Generator of the draws (None: the default one)."""
        n, P = len(rows), max(len(r) for r in rows)
        if min(len(r) for r in rows) == 0:
            raise ValueError("every prompt needs at least one token")
        if P + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                             f"({self.max_seq_len}); build the engine with a larger max_seq_len")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        Bb = bucket_batch(n)
        self._setup(Bb)
        self._sync_lora()

        # left-pad, plus dummy rows (one pad token) up to the bucket
        tokens = torch.full((Bb, P), self.pad_token_id, dtype=torch.int64)
        pad_len = torch.full((Bb,), P - 1, dtype=torch.int64)
        for b, r in enumerate(rows):
            tokens[b, P - len(r):] = torch.tensor(r, dtype=torch.int64)
            pad_len[b] = P - len(r)
        tokens, pad_len = tokens.to(self.device), pad_len.to(self.device)
        self.pad_len.copy_(pad_len)

        T = max_new_tokens
        out_tokens = torch.full((Bb, T), self.pad_token_id, dtype=torch.int64, device=self.device)
        out_mask = torch.zeros(Bb, T, dtype=torch.bool, device=self.device)
        out_lp = torch.zeros(Bb, T, dtype=torch.float32, device=self.device)
        out_ent = torch.zeros(Bb, T, dtype=torch.float32, device=self.device)
        done = torch.arange(Bb, device=self.device) >= n  # dummy rows start finished
        eos = torch.tensor(self.eos_token_ids if not ignore_eos else [], dtype=torch.int64, device=self.device)

        logits = self.prefill(tokens, pad_len)
        # one launch per step draws the token and does the bookkeeping below (CUDA, no top-k / top-p)
        fused = self.fused_sampling and fused_sampling_applies(logits, sampling)
        if fused:
            from ..kernels.triton_sampling import sample_triton

            seed = 2**32 if sampling.greedy else philox_seed(gen, self.device)
        steps = T
        for i in range(T):
            if fused:
                sample_triton(logits, sampling.temperature, seed, i, record=dict(
                    done=done, eos=eos, pad_id=self.pad_token_id, tokens=out_tokens[:, i], mask=out_mask[:, i],
                    logprobs=out_lp[:, i], entropies=out_ent[:, i], step_tokens=self.step_tokens))
            else:
                tok, lp, ent = next_token(logits, sampling, gen)
                alive = ~done
                out_tokens[:, i] = torch.where(alive, tok, self.pad_token_id)
                out_mask[:, i] = alive
                out_lp[:, i] = lp * alive
                out_ent[:, i] = ent * alive
                done = done | torch.isin(tok, eos)
            if i == T - 1:
                break
            if (i + 1) % self.check_every == 0:  # the only host syncs: every check_every tokens
                if stop:
                    done = done | stop_string_rows(self.tokenizer, out_tokens[:n, : i + 1], out_mask[:n, : i + 1],
                                                   stop, Bb, self.device)
                if not bool((~done).any()):
                    steps = i + 1
                    break
            if aqn is not None and aqn.per_forward:
                aqn.resample()
            slot = P + i
            if not fused:  # the fused launch wrote it
                self.step_tokens.copy_(tok)
            self.step_slot.fill_(slot)
            logits = self._decode(min(round_up(slot + 1, self.kv_block), self.max_seq_len))

        out_tokens, out_mask, out_lp, out_ent = (t[:n, :steps] for t in (out_tokens, out_mask, out_lp, out_ent))
        texts, cut = None, [False] * n
        if stop:
            out_mask, cut = cut_at_stop_strings(self.tokenizer, out_tokens, out_mask, stop)
        out_tokens = out_tokens.masked_fill(~out_mask, self.pad_token_id)
        out_lp, out_ent = out_lp * out_mask, out_ent * out_mask
        finish = finish_reasons(out_tokens, out_mask, cut, self.eos_token_ids, ignore_eos)
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(t[m].tolist(), skip_special_tokens=True)
                     for t, m in zip(out_tokens.cpu(), out_mask.cpu())]
        return Rollout(tokens[:n], self.cache.key_valid[:n, :P].clone(), out_tokens, out_mask, out_lp, out_ent,
                       finish, texts)

    @torch.no_grad()
    def warmup(self, batch: int, max_len: int | None = None) -> None:
        """Capture now every decode graph a batch of `batch` rows up to `max_len` slots will need (so the
        first timed or trained rollout does not pay for the captures). No-op without CUDA graphs."""
        Bb = bucket_batch(batch)
        self._setup(Bb)
        self._sync_lora()
        if not self.cuda_graphs:
            return
        max_len = max_len or self.max_seq_len
        self.cache.reset(torch.zeros(Bb, dtype=torch.int64, device=self.device))
        self.pad_len.zero_()
        for kv_len in range(self.kv_block, round_up(max_len, self.kv_block) + 1, self.kv_block):
            kv_len = min(kv_len, self.max_seq_len)
            self.step_slot.fill_(kv_len - 1)
            self._decode(kv_len)

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
        sig = lora.signature()
        if sig != self._graph_sig:
            lora.clear()
            self.decode_graphs.reset()
            self._graph_sig = sig
        lora.refresh()

    def release_memory(self) -> int:
        """Free the KV cache, the static step buffers and the captured graphs (returns the cache bytes
        freed), e.g. before the training backward needs the memory; the next `generate` allocates and
        captures them again (one graph capture per attended-length block: about 1-3% of a long rollout)."""
        freed = self.cache.nbytes() if self.cache is not None else 0
        self.cache = None
        self.decode_graphs.reset()
        for name in ("step_tokens", "step_slot", "pad_len", "slots", "step_logits"):
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
