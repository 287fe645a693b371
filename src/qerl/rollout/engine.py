"""Batched sampling from the policy the trainer is optimizing: same module objects, LoRA never merged.

The engine does not copy the model. Each step runs the model's own modules in order -- `embed_tokens`,
per layer `input_layernorm`, `q_proj`/`k_proj`/`v_proj` (+ Qwen3 `q_norm`/`k_norm`), `o_proj`,
`post_attention_layernorm`, `gate_proj`/`up_proj`/`down_proj` with the MLP's `act_fn`, final `norm`,
`lm_head` -- so a LoRA update or an AQN perturbation of a norm weight is what samples next. What the
engine brings itself: rotary embeddings computed from the HF config, attention over a static KV cache
(torch SDPA; on CUDA the decode steps use a flash-decoding Triton kernel, `qerl.kernels.decode_attention`),
and the sampling (on CUDA one Triton launch per step draws the tokens and records them,
`qerl.kernels.triton_sampling`). On CUDA each residual add with the RMSNorm after it, RoPE on q/k (at
decode, with the k/v cache write) and SiLU(gate) * up run as one Triton launch each
(`qerl.kernels.fused_ops`; the norm's own weight and eps are read on every call, so AQN's in-place noise
is seen); elsewhere the same ops run eagerly.

Quantized layers (`QuantLinear`) are called through their parts: the base matmul on the stored 4-bit (or
bf16) tensors, read by reference, plus the LoRA delta from a snapshot of A and scaling*B cast to the
activation dtype once per `generate` call (r x K, a few MB for a 7B model). The snapshot is refreshed
from the trainer's fp32 masters at the start of every call, so the adapter just updated is the one that
samples; it saves two casts per layer per token and lets a CUDA graph read fixed addresses. Dropout is
never applied while sampling. On CUDA the quantized q/k/v and gate/up siblings are stored back to back
once (`qerl.models.siblings`), so each group decodes as one base matmul with one LoRA product. On Hopper and newer
the decode step's kernels are chained by programmatic dependent launch (`qerl.kernels.pdl`): each launches
while its predecessor runs and prefetches its static weight bytes before waiting for the activations.

Shapes: B batch (padded up to a bucket), P prompt length (left-padded), S cache length, H query heads,
KV key/value heads, G = H / KV, hd head dim, D hidden, V vocabulary.
"""

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import dequantized_weights, quantized_linear
from ..kernels.bf16_matmul import bf16_linear
from ..kernels.decode_attention import decode_attention
from ..kernels.lora_a import lora_a
from ..kernels.fused_ops import add_norm, rope_qk, rope_qk_store, silu_mul
from ..kernels.pdl import programmatic_launches
from ..models.siblings import fuse_sibling_storage, fused_tensors
from ..nn.quant_embedding import QuantEmbedding
from ..nn.quant_linear import QuantLinear
from .kv_cache import KVCache
from .sampling import SamplingParams, fused_sampling_applies, next_token, philox_seed

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class Rollout:
    """What `generate` returns; every tensor on the engine's device, rows in prompt order.

    prompt_ids      [B, P] int64, left-padded with pad_token_id; prompt_mask [B, P] bool (True = real token)
    completion_ids  [B, T] int64, right-padded with pad_token_id after the end of each completion
    completion_mask [B, T] bool, True for generated tokens up to and including the stop token (EOS or the
                    token that completed a stop string)
    logprobs        [B, T] fp32, log pi(token) under softmax(logits / T) of the policy that sampled
                    (noise included when AQN is on); 0 where the mask is False
    entropies       [B, T] fp32, entropy of that distribution at each position; 0 where the mask is False
    finish_reason   per row "stop" (EOS or stop string) or "length"
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor
    finish_reason: list[str] = field(default_factory=list)
    texts: list[str] | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64 number of completion tokens per row."""
        return self.completion_mask.sum(-1)

    @staticmethod
    def concat(parts: Sequence["Rollout"], pad_token_id: int) -> "Rollout":
        """Rows of all parts in order; prompts re-left-padded and completions re-right-padded to the widest."""
        return Rollout(
            _pad_cat([r.prompt_ids for r in parts], pad_token_id, left=True),
            _pad_cat([r.prompt_mask for r in parts], False, left=True),
            _pad_cat([r.completion_ids for r in parts], pad_token_id, left=False),
            _pad_cat([r.completion_mask for r in parts], False, left=False),
            _pad_cat([r.logprobs for r in parts], 0.0, left=False),
            _pad_cat([r.entropies for r in parts], 0.0, left=False),
            [f for r in parts for f in r.finish_reason],
            None if any(r.texts is None for r in parts) else [t for r in parts for t in r.texts])


def _pad_cat(tensors: Sequence[torch.Tensor], value, left: bool) -> torch.Tensor:
    """Concatenate [n_i, L_i] tensors along rows, padding each to max L_i on the left or right."""
    width = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
        out.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------- rope


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """inv_freq [hd/2] fp32 and the cos/sin scale, from `rope_parameters` (transformers 5) or `rope_theta`.

    Default RoPE is computed here exactly as HF does (same fp32 ops, so the same bits); scaled variants
    (llama3, yarn, linear, ...) use transformers' own init functions; dynamic ones change with the sequence
    length at run time, which a static cache cannot follow, so they are refused.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope_type {rope_type!r} changes with sequence length; not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rope_tables(config, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, hd] in dtype for positions 0..max_len-1 (HF layout: the two halves repeat)."""
    inv_freq, scale = rope_inv_freq(config)
    freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype).to(device), (emb.sin() * scale).to(dtype).to(device)


# ------------------------------------------------------------------------------------------ linears


class LoraSnapshot:
    """Activation-dtype copies of the enabled adapters, refreshed in place from the trainer's fp32 masters.

    Linears are registered in groups of siblings that read the same input (q/k/v, gate/up, o, down). For a
    group the A matrices are stacked, [sum r, K], so the whole group's x @ A^T is one GEMM; each member then
    adds its slice times scaling*B [N, r] onto its base output, inside the NVFP4 decode kernel's launch where
    that kernel applies, else in one addmm. At decode sizes these small GEMMs are launch-bound, so fewer of
    them is what counts. In-place refresh keeps addresses fixed, so captured CUDA graphs read the new adapter.

    Sibling groups whose weights are stored back to back (`qerl.models.siblings`, done here when fuse=True)
    run as ONE base matmul over the concatenated rows: their biases are concatenated into a snapshot too,
    and the B matrices placed block-diagonally in one [sum N, sum r] matrix, so the LoRA term of the whole
    group is one product as well.
    """

    def __init__(self, groups: Sequence[Sequence[nn.Module]], dtype: torch.dtype, fuse: bool = False):
        self.dtype = dtype
        self.groups = [tuple(g) for g in groups]
        self.index = {id(m): gi for gi, g in enumerate(self.groups) for m in g}
        self.a: dict[int, torch.Tensor] = {}  # group index -> stacked A [sum r, K]
        self.b: dict[int, tuple[int, int, torch.Tensor]] = {}  # id(module) -> (row0, row1 of A, scaling*B)
        # group index -> fused base tensors, output sizes, concatenated bias | None, block scaling*B | None
        self.fused: dict[int, tuple[dict, list[int], torch.Tensor | None, torch.Tensor | None]] = {}
        self.fuse = fuse
        if fuse:
            for g in self.groups:
                if len(g) > 1:
                    fuse_sibling_storage(g)
        self.refresh()

    @staticmethod
    def _enabled(m: nn.Module) -> bool:
        return isinstance(m, QuantLinear) and m.lora_A is not None and m.lora_enabled

    def signature(self) -> tuple:
        """What the captured graphs depend on: which adapters are on and their shapes, which groups are fused."""
        return tuple((self._enabled(m), tuple(m.lora_A.weight.shape) if self._enabled(m) else None)
                     for g in self.groups for m in g) + tuple(
            len(g) > 1 and fused_tensors(g) is not None for g in self.groups)

    def clear(self) -> None:
        self.a.clear(), self.b.clear(), self.fused.clear()

    @staticmethod
    def _keep(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """new's values at old's address when the shapes agree (what a captured graph reads)."""
        if old is not None and old.shape == new.shape:
            return old.copy_(new)
        return new

    @torch.no_grad()
    def refresh(self) -> None:
        for gi, group in enumerate(self.groups):
            on = [m for m in group if self._enabled(m)]
            if not on:
                self.a.pop(gi, None)
            else:
                self.a[gi] = self._keep(self.a.get(gi), torch.cat([m.lora_A.weight for m in on]).to(self.dtype))
            row = 0
            for m in on:
                r = m.lora_A.weight.shape[0]
                b = self._keep(self.b[id(m)][2] if id(m) in self.b else None,
                               (m.lora_B.weight.float() * m.scaling).to(self.dtype))
                self.b[id(m)] = (row, row + r, b)
                row += r
            self._refresh_fused(gi, group, on)

    def _refresh_fused(self, gi: int, group: tuple, on: list) -> None:
        tensors = fused_tensors(group) if self.fuse and len(group) > 1 else None
        if tensors is None:
            self.fused.pop(gi, None)
            return
        _, _, old_bias, old_lb = self.fused.get(gi, (None, None, None, None))
        sizes = [m.out_features for m in group]
        bias = None
        if group[0].bias is not None:
            bias = self._keep(old_bias, torch.cat([m.bias for m in group]).to(self.dtype))
        lb = None
        if on:
            block = torch.zeros(sum(sizes), self.a[gi].shape[0], dtype=self.dtype, device=self.a[gi].device)
            n0 = 0
            for m, n in zip(group, sizes):
                if id(m) in self.b and self._enabled(m):
                    r0, r1, b = self.b[id(m)]
                    block[n0:n0 + n, r0:r1] = b
                n0 += n
            lb = self._keep(old_lb, block)
        self.fused[gi] = (tensors, sizes, bias, lb)

    def linears(self, mods: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., K] -> [mod(x) for mod in mods] (one registered group), without dropout."""
        gi = self.index.get(id(mods[0]))
        a = self.a.get(gi)
        h = None if a is None else lora_a(x, a)  # [M, sum r]: one launch at decode sizes on CUDA
        fused = self.fused.get(gi)
        if fused is not None and tuple(mods) == self.groups[gi]:
            tensors, sizes, bias, lb = fused
            lora = None if h is None or lb is None else (h, lb)
            y = quantized_linear(mods[0].weight_format, x, tensors, bias, lora=lora)
            return list(y.split(sizes, dim=-1))  # column slices: views, no copy
        outs = []
        for mod in mods:
            if not isinstance(mod, QuantLinear):
                # a plain nn.Linear (an unquantized model) takes the bf16 decode kernel where it applies
                outs.append(bf16_linear(x, mod.weight, mod.bias) if type(mod) is nn.Linear else mod(x))
                continue
            entry = self.b.get(id(mod)) if h is not None else None
            lora = None
            if entry is not None and self._enabled(mod):
                r0, r1, b = entry
                lora = (h[:, r0:r1], b)
            # the "+ h @ (scaling B)^T" rides in the NVFP4 decode kernel's launch, else it is one addmm
            outs.append(quantized_linear(mod.weight_format, x, mod.quantized_tensors(), mod.bias, lora=lora))
        return outs

    def linear(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.linears((mod,), x)[0]


# --------------------------------------------------------------------------------------------- model


class CausalLMRunner:
    """The forward pass of a HF Llama/Mistral/Qwen2/Qwen3 causal LM over a KVCache, from its own modules."""

    def __init__(self, model: nn.Module, max_len: int, fuse_siblings: bool | None = False):
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"rollout engine supports {SUPPORTED_MODEL_TYPES}, not model_type {config.model_type!r}")
        layer_types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types or (
                config.model_type == "mistral" and window is not None and window < max_len):
            raise NotImplementedError("sliding-window attention is not supported by the rollout engine")
        self.model = model
        self.config = config
        body = model.model
        self.embed, self.layers, self.norm, self.lm_head = body.embed_tokens, body.layers, body.norm, model.lm_head
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.scale = getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        # nn.Embedding, or qerl's QuantEmbedding (4-bit table, no `.weight`; called as a module all the same)
        self.dtype = self.embed.dtype if isinstance(self.embed, QuantEmbedding) else self.embed.weight.dtype
        self.device = self.embed.device if isinstance(self.embed, QuantEmbedding) else self.embed.weight.device
        self.max_len = max_len
        self.cos, self.sin = rope_tables(config, max_len, self.dtype, self.device)
        groups = []
        for layer in self.layers:
            at, mlp = layer.self_attn, layer.mlp
            groups += [(at.q_proj, at.k_proj, at.v_proj), (at.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
        fuse = self.device.type == "cuda" if fuse_siblings is None else fuse_siblings  # None: on CUDA only
        self.lora = LoraSnapshot(groups, self.dtype, fuse=fuse)

    # one decoder layer ---------------------------------------------------------------------------

    def attention(self, i: int, x: torch.Tensor, cos, sin, cache: KVCache, mask, slot) -> torch.Tensor:
        """x [B, L, D] (already normed) -> attention output [B, L, D]; writes this layer's k/v.
        cos, sin [B, L, hd]: the RoPE tables at each token's position.

        slot None: prefill of slots 0..L-1, attending over the L new keys. Otherwise decode (L = 1) of
        slot `slot`, attending over the first mask.shape[-1] slots of the cache.
        """
        attn, lin = self.layers[i].self_attn, self.lora.linear
        B, L, _ = x.shape
        q, k, v = self.lora.linears((attn.q_proj, attn.k_proj, attn.v_proj), x)
        q = q.view(B, L, self.n_heads, self.head_dim)
        k = k.view(B, L, self.n_kv, self.head_dim)
        v = v.view(B, L, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        if slot is not None:  # decode: RoPE + this slot's k/v written into the cache, one launch on CUDA
            q = rope_qk_store(q, k, v, cos, sin, cache.k[i], cache.v[i], slot)
            S = mask.shape[-1]
            if q.is_cuda:  # one flash-decoding launch (two with split S) instead of SDPA + mask conversion
                o = decode_attention(q[:, 0], cache.k[i], cache.v[i], cache.key_valid, slot, S, self.scale)
                return lin(attn.o_proj, o.reshape(B, L, self.n_heads * self.head_dim))
            k, v = cache.k[i][:, :, :S], cache.v[i][:, :, :S]
            q = q.transpose(1, 2)
        else:
            q, k = rope_qk(q, k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            cache.write_prefill(i, k, v)
        o = grouped_attention(q, k, v, mask, self.scale)  # [B, H, L, hd]
        return lin(attn.o_proj, o.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim))

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, D] (already normed) -> down(act(gate(x)) * up(x)) [B, L, D]."""
        mlp = self.layers[i].mlp
        gate, up = self.lora.linears((mlp.gate_proj, mlp.up_proj), x)
        return self.lora.linear(mlp.down_proj, silu_mul(gate, up, mlp.act_fn))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask, slot=None):
        """tokens [B, L] int64, positions [B, L] int64 (RoPE positions) -> last-position logits [B, V]."""
        cos, sin = self.cos[positions], self.sin[positions]  # [B, L, hd]
        # residual adds fused with the norm that follows them (one launch each on CUDA, see fused_ops)
        h, x = add_norm(self.embed(tokens), None, self.layers[0].input_layernorm)
        for i, layer in enumerate(self.layers):
            h, x = add_norm(h, self.attention(i, x, cos, sin, cache, mask, slot), layer.post_attention_layernorm)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = add_norm(h, self.mlp(i, x), nxt)
        head = self.lm_head
        if type(head) is nn.Linear:  # the bf16 decode kernel where it applies (1.05x cuBLAS, and PDL)
            return bf16_linear(x[:, -1], head.weight, head.bias)
        return head(x[:, -1])


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [B, H, L, hd], k/v [B, KV, S, hd], mask [B, 1, L, S] bool (True = attend) -> [B, H, L, hd].

    GQA without repeating k/v: the G query heads of one kv head are folded into the query-length axis
    ([B, KV, G*L, hd]), so SDPA reads the cache once instead of a G-times copy of it.
    """
    B, H, L, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    qg = q.reshape(B, KV, G * L, hd)  # heads h = kv*G + g are contiguous, as in HF's repeat_kv
    if L > 1:
        mask = mask.expand(B, 1, L, mask.shape[-1])
        mask = mask[:, :, None].expand(B, 1, G, L, mask.shape[-1]).reshape(B, 1, G * L, mask.shape[-1])
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(B, H, L, hd)


# ------------------------------------------------------------------------------------------- engine


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def bucket_batch(n: int) -> int:
    """Smallest batch bucket >= n (one captured graph per bucket)."""
    for b in BATCH_BUCKETS:
        if b >= n:
            return b
    return _round_up(n, BATCH_BUCKETS[-1])


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
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._mempool = None
        self._graph_sig = None

    # setup ----------------------------------------------------------------------------------------

    def _setup(self, batch: int) -> None:
        """Allocate the cache and static step buffers for a batch bucket (once per bucket change)."""
        if self.cache is not None and self.cache.batch == batch:
            return
        self.cache = None  # free first: the old cache may be most of the free memory
        self._reset_graphs()
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
        """tokens [B, P] left-padded, pad_len [B] -> logits of the last prompt token [B, V]; fills slots < P."""
        B, P = tokens.shape
        self.cache.reset(pad_len)
        positions = (self.slots[:P][None, :] - pad_len[:, None]).clamp_min(0)
        causal = self.slots[:P][None, :] <= self.slots[:P][:, None]  # [P(query), P(key)]
        # pads attend to themselves only: a fully masked softmax row would be nan and leak through v
        mask = (causal[None] & self.cache.key_valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=self.device)
        return self.runner.forward(tokens, positions, self.cache, mask[:, None])

    def decode_one_token(self, kv_len: int) -> torch.Tensor:
        """Feed step_tokens [B] at slot step_slot; returns logits [B, V] (in step_logits).

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
        if not self.cuda_graphs:
            return self.decode_one_token(kv_len)
        key = (self.cache.batch, kv_len)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(kv_len)
        graph.replay()
        return self.step_logits

    def _capture(self, kv_len: int) -> "torch.cuda.CUDAGraph":
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture one step.

        Warm-up runs write the same k/v the real step will write (same inputs), so they are harmless.
        """
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.decode_one_token(kv_len)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool()):
            self.decode_one_token(kv_len)
        return graph

    def _pool(self):
        # one memory pool for all graphs: they never run concurrently and each writes its result to the
        # static step_logits before the next replay, so their temporaries may share memory
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        return self._mempool

    def _reset_graphs(self) -> None:
        """Drop every captured graph and their pool (a new pool: capturing into the pool of destroyed
        graphs trips the caching allocator)."""
        self.graphs = {}
        self._mempool = None

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

    def rows_per_pass(self, n: int, seq_len: int) -> int:
        """Rows one generate pass may hold: n, or fewer when its batch bucket (what the cache is allocated
        for) exceeds `max_batch` or, by default on CUDA, what `memory_fraction` of the free memory holds.
        seq_len (prompt + new tokens) is only checked against max_seq_len."""
        if seq_len > self.max_seq_len:
            return n  # _generate raises the clear error
        limit = self.max_batch
        if limit is None:
            free = self._free_bytes()
            if free is not None:
                limit = int(free * self.memory_fraction) // self._bytes_per_row()
        if limit is None or bucket_batch(n) <= limit:
            return n
        if limit < 1:
            raise torch.OutOfMemoryError(
                f"not even one row's KV cache ({self._bytes_per_row() / 2**30:.2f} GiB for max_seq_len "
                f"{self.max_seq_len}) fits in free GPU memory; lower max_new_tokens or the prompt length")
        return max(b for b in BATCH_BUCKETS if b <= limit)

    def _bytes_per_row(self) -> int:
        """Memory one batch row needs during generate: its K and V over max_seq_len in every layer, plus
        the step logits and the fp32 sampling temporaries over the vocabulary."""
        r = self.runner
        elem = torch.finfo(r.dtype).bits // 8
        kv = 2 * len(r.layers) * r.n_kv * r.head_dim * self.max_seq_len * elem
        return kv + self.model.config.vocab_size * (elem + 3 * 4)

    def _free_bytes(self) -> int | None:
        """Device memory a new cache may use (free + cached by the allocator + the current cache, which
        `_setup` frees first); None off CUDA, where the batch is not split by memory."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if self.cache is not None:
            free += self.cache.nbytes()
        return free

    def _generate(self, rows: list[list[int]], max_new_tokens, sampling, stop, ignore_eos, gen, aqn) -> Rollout:
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
                    done = done | self._stop_string_rows(out_tokens[:n, : i + 1], out_mask[:n, : i + 1], stop, Bb)
                if not bool((~done).any()):
                    steps = i + 1
                    break
            if aqn is not None and aqn.per_forward:
                aqn.resample()
            slot = P + i
            if not fused:  # the fused launch wrote it
                self.step_tokens.copy_(tok)
            self.step_slot.fill_(slot)
            logits = self._decode(min(_round_up(slot + 1, self.kv_block), self.max_seq_len))

        out_tokens, out_mask, out_lp, out_ent = (t[:n, :steps] for t in (out_tokens, out_mask, out_lp, out_ent))
        texts, cut = None, [False] * n
        if stop:
            out_mask, cut = self._cut_at_stop_strings(out_tokens, out_mask, stop)
        out_tokens = out_tokens.masked_fill(~out_mask, self.pad_token_id)
        out_lp, out_ent = out_lp * out_mask, out_ent * out_mask
        finish = self._finish_reasons(out_tokens, out_mask, cut, ignore_eos)
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
        for kv_len in range(self.kv_block, _round_up(max_len, self.kv_block) + 1, self.kv_block):
            kv_len = min(kv_len, self.max_seq_len)
            self.step_slot.fill_(kv_len - 1)
            self._decode(kv_len)

    # helpers --------------------------------------------------------------------------------------

    def _sync_lora(self) -> None:
        """Refresh the adapter snapshot from the trainer's weights; drop graphs if the adapter set changed."""
        lora = self.runner.lora
        sig = lora.signature()
        if sig != self._graph_sig:
            lora.clear()
            self._reset_graphs()
            self._graph_sig = sig
        lora.refresh()

    def release_memory(self) -> int:
        """Free the KV cache, the static step buffers and the captured graphs (returns the cache bytes
        freed), e.g. before the training backward needs the memory; the next `generate` allocates and
        captures them again (one graph capture per attended-length block: about 1-3% of a long rollout)."""
        freed = self.cache.nbytes() if self.cache is not None else 0
        self.cache = None
        self._reset_graphs()
        for name in ("step_tokens", "step_slot", "pad_len", "slots", "step_logits"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def invalidate_graphs(self) -> None:
        """Call after replacing (not updating in place) any parameter or buffer the model reads."""
        self._reset_graphs()
        self.runner.lora.clear()

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _stop_string_rows(self, tokens, mask, stop, Bb) -> torch.Tensor:
        """[Bb] bool: rows whose completion so far contains a stop string (one host copy)."""
        hit = torch.zeros(Bb, dtype=torch.bool)
        for b, (t, m) in enumerate(zip(tokens.cpu(), mask.cpu())):
            text = self._decode_text(t[m].tolist())
            hit[b] = any(s in text for s in stop)
        return hit.to(self.device)

    def _cut_at_stop_strings(self, tokens, mask, stop) -> tuple[torch.Tensor, list[bool]]:
        """Keep each row up to and including the first token whose text completes a stop string.
        Returns the new mask [B, T] and which rows were cut."""
        mask, cut = mask.clone(), []
        for b, (t, m) in enumerate(zip(tokens.cpu(), mask.cpu())):
            ids = t[m].tolist()
            has_stop = lambda k: any(s in self._decode_text(ids[:k]) for s in stop)  # noqa: E731
            cut.append(has_stop(len(ids)))
            if not cut[-1]:
                continue
            lo, hi = 1, len(ids)  # smallest prefix holding a stop string; text grows with the prefix
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
            mask[b, lo:] = False
        return mask, cut

    def _finish_reasons(self, tokens, mask, cut, ignore_eos) -> list[str]:
        """"stop" where the row ended on EOS or was cut at a stop string, else "length"."""
        n = mask.sum(-1, keepdim=True)
        last = tokens.gather(1, (n - 1).clamp_min(0)).squeeze(1).tolist()
        eos = set() if ignore_eos else set(self.eos_token_ids)
        return ["stop" if (c or (k > 0 and tok in eos)) else "length"
                for c, k, tok in zip(cut, n.squeeze(1).tolist(), last)]


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
