"""The forward pass of a HF causal LM over the static KV cache, built from the model's own modules.

The runner does not copy the model. Each forward runs the model's own modules in order -- `embed_tokens`,
per layer `input_layernorm`, `q_proj`/`k_proj`/`v_proj` (+ Qwen3 `q_norm`/`k_norm`), `o_proj`,
`post_attention_layernorm`, `gate_proj`/`up_proj`/`down_proj` with the MLP's `act_fn`, final `norm`,
`lm_head` -- so a LoRA update or an AQN perturbation of a norm weight is what samples next. What the
runner brings itself: rotary embeddings computed from the HF config (`rope`), the linears through the
adapter snapshot (`lora_snapshot`), and attention over the static KV cache (torch SDPA; on CUDA the decode
steps use a flash-decoding Triton kernel, `qerl.kernels.decode_attention`, gpt-oss's sinks and windows
included; with `decode_attention.FUSED_ROPE_STORE` that kernel also applies RoPE to q and k and writes the
slot's k/v into the cache, `rope_store_decode_attention`). On CUDA each residual add with the RMSNorm after it,
RoPE on q/k (at decode, with the k/v cache write, unless the attention kernel does it) and SiLU(gate) * up run as
one Triton launch each (`qerl.kernels.fused_ops`; the norm's own weight and
eps are read on every call, so AQN's in-place noise is seen), and at decode rows the norm before q/k/v and before
gate/up also computes their LoRA A product in its launch (`add_norm_lora_a`); elsewhere the same ops run eagerly.

Mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE: an `mlp` with `experts` and a router `gate`) run their
sparse-MoE block as the model does, `mlp(x)` on the normed x [B, L, D] (router, top-k, experts -- HF's or
qerl's 4-bit `QuantExperts` -- and Qwen2-MoE's gated shared expert), so AQN's noise on
`post_attention_layernorm` reaches the router and the experts. With qerl's 4-bit experts on their grouped
kernel path (`QuantExperts.capturable`; with expert LoRA also `torch._grouped_mm`) a block never syncs with
the host, so the engine captures its decode
steps in CUDA graphs like a dense model's; HF's 16-bit experts loop (`.tolist()`, `nonzero`) and the
per-expert reference path do sync, so an engine over such a model decodes eagerly
(`CausalLMRunner.moe_capturable`). Which path a layer takes is decided once, here at construction.

gpt-oss: q/k/v/o carry biases (the adapter snapshot applies them), its MoE block has a `router` instead of
a `gate` (run whole, as above), every attention has per-head sinks (one extra logit in each softmax's
denominator, `qerl.nn.sinks`) and every other layer a sliding window (`config.layer_types`; key j visible to
the query at position p iff p - j < window, transformers' rule; a row's position is its cache slot). At
prefill those layers attend through SDPA with a float mask; CUDA decode steps take the flash-decoding kernel,
which adds the sink to its softmax and scans only the window's slots (`decode_attention(..., sinks, window)`;
`SINKS_WINDOW_DECODE_KERNEL = False` sends them through SDPA as at prefill, the path the kernel is tested
against).
Other architectures with a sliding window are still refused.

Shapes: B batch, L tokens fed (the prompt length P at prefill, 1 at decode), S attended cache length,
H query heads, KV key/value heads, G = H / KV, hd head dim, D hidden, V vocabulary. Activations are in
the model's dtype (`CausalLMRunner.dtype`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.bf16_matmul import bf16_linear
from ..kernels import decode_attention, fused_ops
from ..kernels.decode_attention import rope_store_decode_attention
from ..kernels.fused_ops import add_norm_lora_a, rope_qk, rope_qk_store, silu_mul, silu_mul_lora_a
from ..nn.quant_embedding import QuantEmbedding
from ..nn.quant_experts import QuantExperts
from ..nn.sinks import with_sink_column
from .lora_snapshot import LoraSnapshot
from .rope import rope_tables

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gpt_oss")
# architectures whose per-layer sliding windows (config.layer_types) the runner applies
LAYER_WINDOW_MODEL_TYPES = ("gpt_oss",)
# True: CUDA decode steps of layers with sinks and/or a sliding window (gpt-oss) through the flash-decoding
# kernel; False: through SDPA with a float mask, as at prefill (the reference the engine test compares with;
# at the gpt-oss-20b shape the kernel makes the rollout 3.2x faster, docs/benchmarks.md).
SINKS_WINDOW_DECODE_KERNEL = True


def is_moe_block(mlp: nn.Module) -> bool:
    """A sparse-MoE block (stacked `experts` and a router, `gate` or gpt-oss's `router`), not a dense
    gate/up/down MLP."""
    return hasattr(mlp, "experts") and (hasattr(mlp, "gate") or hasattr(mlp, "router")) \
        and not hasattr(mlp, "gate_proj")


def layer_windows(config, n_layers: int) -> list[int | None]:
    """Per layer the sliding window (keys visible: position - key < window) or None (full attention)."""
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" else None for t in types]


class CausalLMRunner:
    """The forward pass of a HF Llama/Mistral/Qwen2/Qwen3(-MoE) causal LM over a KVCache, from its own modules."""

    def __init__(self, model: nn.Module, max_len: int, fuse_siblings: bool | None = False):
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"rollout engine supports {SUPPORTED_MODEL_TYPES}, not model_type {config.model_type!r}")
        layer_types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        if config.model_type not in LAYER_WINDOW_MODEL_TYPES and (
                getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types or (
                config.model_type == "mistral" and window is not None and window < max_len)):
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
        self.moe_layers = []  # per layer: its mlp is a sparse-MoE block (run whole, `moe_mlp`)
        windowed = config.model_type in LAYER_WINDOW_MODEL_TYPES
        self.windows = layer_windows(config, len(self.layers)) if windowed else [None] * len(self.layers)
        # gpt-oss's per-head sink logits [H] (read on every call: the parameter itself, never a copy)
        self.has_sinks = [getattr(layer.self_attn, "sinks", None) is not None for layer in self.layers]
        for i, layer in enumerate(self.layers):
            at, mlp = layer.self_attn, layer.mlp
            groups += [(at.q_proj, at.k_proj, at.v_proj), (at.o_proj,)]
            moe = is_moe_block(mlp)
            if not moe:
                if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                    raise NotImplementedError(f"layer {i}: mlp {type(mlp).__name__} is neither a gate/up/down MLP "
                                              f"nor a sparse-MoE block (experts + gate)")
                groups += [(mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
            self.moe_layers.append(moe)
        self.has_moe = any(self.moe_layers)
        self.moe_capturable = self.moe_blocks_capturable()
        self._mlps = [self.moe_mlp if moe else self.mlp for moe in self.moe_layers]  # chosen once per layer
        fuse = self.device.type == "cuda" if fuse_siblings is None else fuse_siblings  # None: on CUDA only
        self.lora = LoraSnapshot(groups, self.dtype, fuse=fuse)
        # per norm in forward order (the first input_layernorm, then each layer's post_attention_layernorm and
        # the next norm): the first linear of the group it feeds (q_proj, gate_proj of a dense MLP, the next
        # q_proj; None for an MoE block, whose router reads the norm, and for the final norm before lm_head)
        self._feeds = [self.layers[0].self_attn.q_proj]
        for i, (layer, moe) in enumerate(zip(self.layers, self.moe_layers)):
            self._feeds.append(None if moe else layer.mlp.gate_proj)
            self._feeds.append(self.layers[i + 1].self_attn.q_proj if i + 1 < len(self.layers) else None)
        self.fuse_norm_lora_a = True  # the norm launch also computes the LoRA A product (decode rows, CUDA)

    def add_norm(self, h, delta, norm, feeds):
        """(h + delta, norm(h + delta), its LoRA A product for the group `feeds` starts or None): the decode
        step's residual add + norm launch, which also computes that product where it can
        (`fused_ops.add_norm_lora_a`; `fuse_norm_lora_a` off: never)."""
        a = self.lora.stacked_a(feeds) if feeds is not None and self.fuse_norm_lora_a else None
        return add_norm_lora_a(h, delta, norm, a)

    def moe_blocks_capturable(self) -> bool:
        """Every MoE block free of host syncs: its experts are qerl's and take the grouped kernel (and, with
        expert LoRA, `torch._grouped_mm`) in this dtype. True for a model without MoE blocks."""
        return all(
            isinstance(layer.mlp.experts, QuantExperts) and layer.mlp.experts.capturable(self.dtype, self.device)
            for layer, moe in zip(self.layers, self.moe_layers) if moe)

    def experts_lora_signature(self) -> tuple:
        """What captured decode graphs read of the experts' LoRA: per MoE block whether it is on and its factors'
        addresses (a graph reads the fp32 masters in place, which the optimizer updates in place; new tensors,
        e.g. from loading an adapter, need a new capture)."""
        sig = []
        for layer, moe in zip(self.layers, self.moe_layers):
            experts = layer.mlp.experts if moe else None
            if isinstance(experts, QuantExperts) and experts.lora_active:
                sig.append(tuple(p.data_ptr() for p in (*experts.lora_A.values(), *experts.lora_B.values())))
            else:
                sig.append(None)
        return tuple(sig)

    # one decoder layer ---------------------------------------------------------------------------

    def attention(self, i: int, x: torch.Tensor, cos, sin, cache, mask, slot, xa=None) -> torch.Tensor:
        """x [B, L, D] (already normed) -> attention output [B, L, D]; writes this layer's k/v. xa: x's LoRA A
        product for q/k/v when the norm computed it (`LoraSnapshot.linears`).
        cos, sin [B, L, hd]: the RoPE tables at each token's position. mask [B, 1, L, S] bool (True = attend).

        slot None: prefill of slots 0..L-1, attending over the L new keys. Otherwise decode (L = 1) of
        slots `slot` (int64 [B] or 0-dim), attending over the first mask.shape[-1] slots of the cache.
        """
        attn, lin = self.layers[i].self_attn, self.lora.linear
        B, L, _ = x.shape
        q, k, v = self.lora.linears((attn.q_proj, attn.k_proj, attn.v_proj), x, xa)
        q = q.view(B, L, self.n_heads, self.head_dim)
        k = k.view(B, L, self.n_kv, self.head_dim)
        v = v.view(B, L, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        window, sinks = self.windows[i], attn.sinks if self.has_sinks[i] else None
        if slot is not None:  # decode: RoPE + this slot's k/v written into the cache, then attention
            S = mask.shape[-1]
            plain = window is None and sinks is None
            if q.is_cuda and (plain or SINKS_WINDOW_DECODE_KERNEL):  # the flash-decoding kernel (two launches with
                # splits), RoPE + the k/v write before it or inside it (`decode_attention.FUSED_ROPE_STORE`)
                a_o = self.lora.stacked_a(attn.o_proj) if decode_attention.FUSED_LORA_A_O else None
                o = rope_store_decode_attention(q, k, v, cos, sin, cache.k[i], cache.v[i], cache.key_valid, slot,
                                                S, self.scale, sinks=sinks, window=window, lora_a=a_o)
                if a_o is not None:  # o_proj's LoRA A product came out of the attention kernel
                    o, h = o
                    return self.lora.linears((attn.o_proj,), o.reshape(B, L, self.n_heads * self.head_dim), h)[0]
                return lin(attn.o_proj, o.reshape(B, L, self.n_heads * self.head_dim))
            q = rope_qk_store(q, k, v, cos, sin, cache.k[i], cache.v[i], slot)
            k, v = cache.k[i][:, :, :S], cache.v[i][:, :, :S]
            q = q.transpose(1, 2)
        else:
            q, k = rope_qk(q, k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            cache.write_prefill(i, k, v)
        if window is not None:
            mask = mask & within_window(mask, slot, window)
        if sinks is not None:
            o = sink_attention(q, k, v, mask, self.scale, sinks)
        else:
            o = grouped_attention(q, k, v, mask, self.scale)  # [B, H, L, hd]
        return lin(attn.o_proj, o.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim))

    def mlp(self, i: int, x: torch.Tensor, xa=None) -> torch.Tensor:
        """x [B, L, D] (already normed) -> down(act(gate(x)) * up(x)) [B, L, D]; xa: x's LoRA A product for
        gate/up when the norm computed it."""
        mlp = self.layers[i].mlp
        gate, up = self.lora.linears((mlp.gate_proj, mlp.up_proj), x, xa)
        if fused_ops.FUSED_SILU_LORA_A and (a_down := self.lora.stacked_a(mlp.down_proj)) is not None:
            act, h = silu_mul_lora_a(gate, up, mlp.act_fn, a_down)  # h None where the launch could not do it
            return self.lora.linears((mlp.down_proj,), act, h)[0]
        return self.lora.linear(mlp.down_proj, silu_mul(gate, up, mlp.act_fn))

    def moe_mlp(self, i: int, x: torch.Tensor, xa=None) -> torch.Tensor:
        """x [B, L, D] (already normed) -> the layer's sparse-MoE block output [B, L, D], the block run as the
        model runs it (some transformers versions return (hidden, router_logits): the hidden is kept)."""
        out = self.layers[i].mlp(x)
        return out[0] if isinstance(out, tuple) else out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, mask, slot=None,
                last: torch.Tensor | None = None):
        """tokens [B, L] int64, positions [B, L] int64 (RoPE positions) -> logits [B, V] in the model's dtype
        at position last[b] of each row (int64 [B]; None: the last position). mask [B, 1, L, S] bool (True =
        attend). slot None: a prefill of slots 0..L-1, whose k/v go to `cache.write_prefill` (a
        `kv_cache.PrefillWriter`); else the decode slots (int64 [B], or 0-dim for every row;
        L = 1) of the `KVCache` `cache`."""
        cos, sin = self.cos[positions], self.sin[positions]  # [B, L, hd]
        # residual adds fused with the norm that follows them, and at decode rows with the LoRA A product of
        # the linears that norm feeds (one launch each on CUDA, see fused_ops)
        h, x, xa = self.add_norm(self.embed(tokens), None, self.layers[0].input_layernorm, self._feeds[0])
        for i, layer in enumerate(self.layers):
            h, x, xa = self.add_norm(h, self.attention(i, x, cos, sin, cache, mask, slot, xa),
                                     layer.post_attention_layernorm, self._feeds[2 * i + 1])
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x, xa = self.add_norm(h, self._mlps[i](i, x, xa), nxt, self._feeds[2 * i + 2])
        x = x[:, -1] if last is None else x[torch.arange(x.shape[0], device=x.device), last]
        head = self.lm_head
        if type(head) is nn.Linear:  # the bf16 decode kernel where it applies (1.05x cuBLAS, and PDL)
            return bf16_linear(x, head.weight, head.bias)
        return head(x)


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


def within_window(mask: torch.Tensor, slot, window: int) -> torch.Tensor:
    """bool [B or 1, 1, L, S]: key slot j is within `window` of the query (position = slot: each cache row
    holds its sequence from slot 0). mask [B or 1, 1, L, S] gives the shape; slot None: a prefill, queries
    at slots 0..L-1; else the decode slots (int64 [B] or 0-dim), L = 1."""
    L, S = mask.shape[-2], mask.shape[-1]
    j = torch.arange(S, device=mask.device)
    if slot is None:
        q = torch.arange(L, device=mask.device)[:, None]  # [L, 1]
        return (q - j < window)[None, None]
    q = slot.reshape(-1, 1, 1, 1)  # [B or 1, 1, 1, 1]
    return q - j < window


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """`grouped_attention` with gpt-oss's per-head sinks [H] in every softmax (`qerl.nn.sinks`): q [B, H, L, hd],
    k/v [B, KV, S, hd], mask [B, 1, L, S] bool -> [B, H, L, hd]. k/v are repeated per query head (HF's
    repeat_kv order) for the float mask, which differs per head."""
    H, KV = q.shape[1], k.shape[1]
    if H != KV:
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    q, k, v, float_mask = with_sink_column(q, k, v, mask, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, scale=scale)
