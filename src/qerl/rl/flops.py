"""The useful FLOPs of one policy update, counted from the model config and the token layout the update ran.

"Useful": the products the math of the update needs, once. Per pass over the batch and per decoder layer, with
t the tokens the pass forwards (`PassLayout`), a product y[t, N] = x[t, K] @ W[K, N] costs 2 t N K:

    base linears     q, k, v, o, gate, up, down: 2 t N K forward; the backward's input gradient 2 t N K more
                     (the frozen base has no weight gradient)
    LoRA (rank r)    forward x A^T and (x A^T) B^T: 2 t r (K + N); backward: the gradient into B's input
                     2 t N r, B's weight gradient 2 t N r, A's weight gradient 2 t r K, A's input gradient
                     2 t r K -- 6 t r (K + N) per pass with a backward
    attention        per query head, per (query, key) pair it may see (causal within its packed sequence:
                     `causal_pairs`; a sliding-window layer sees at most `window` keys): Q K^T and P V, 2 x
                     2 head_dim forward; the backward (dV, dP, dQ, dK: 2 head_dim each) 2 x forward
    LM head          the positions whose log-prob the loss takes (not every token): 2 n V hidden forward,
                     2 n V hidden input gradient
    MoE layers       router 2 t E hidden (+ its input gradient); each token's top-k routed experts (gate, up,
                     down at the expert width: 6 t k hidden I forward, as much again for the input gradient);
                     a shared expert as a dense MLP plus its 1-wide gate; expert LoRA (lora.experts) as LoRA over
                     the t k routed rows of gate_up [2I, hidden] and down [hidden, I]

An input gradient is counted only where autograd computes one: the input needs it when it depends on a
trainable parameter. The embedding output does not, so the first layer's q, k, v (and their LoRA A) take no
input gradient, and with LoRA on fewer targets more of the first layer's backward drops out; the LM head's and
every later product's input gradients are counted.

Not counted: gradient checkpointing's recomputation (the decoder layers' and the LM head's chunks are forwarded
twice on the device; only once here), element-wise work (norms, RoPE, activations, softmax, biases, AQN noise,
the loss), attention sinks' extra key, the masked (invisible) part of the padded attention blocks the kernel
computes, padding of the padded path (it forwards every row's full width; counted: each row's real prompt and
loss tokens), the MoE routers' load-balancing loss and, with `moe.train_router`, the routers' weight gradient
(E x hidden per token). The optimizer step is not a product.

Passes of one update: `num_updates` loss passes (forward + backward, LoRA on), the old-log-prob pass (forward,
LoRA on) when num_updates > 1 recomputes pi_old, and the reference pass (forward, LoRA off) when kl_beta > 0.

Architectures: the dense Llama / Mistral / Qwen2 / Qwen3 configs and the mixtures of experts Qwen2-MoE,
Qwen3-MoE and gpt-oss; any other config with experts counts None (unknown routing).
"""

from dataclasses import dataclass

# the decoder layer's linears by leaf name (the LoRA targets' names)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "gpt_oss")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def causal_pairs(prefix: int, length: int, window: int | None = None) -> int:
    """(query, key) pairs of `length` tokens at sequence positions prefix .. prefix + length - 1, each seeing
    every position up to its own (the `prefix` earlier ones included), at most `window` of them (HF's sliding
    window: position q sees keys j with q - j < window)."""

    def upto(m: int) -> int:  # sum over positions 0 .. m-1 of min(position + 1, window)
        if window is None or m <= window:
            return m * (m + 1) // 2
        return window * (window + 1) // 2 + (m - window) * window

    return upto(prefix + length) - upto(prefix)


@dataclass(frozen=True)
class PassLayout:
    """The tokens one pass over the batch forwards (every pass of an update runs the same micro-batches).

    segments: (prefix, length) runs: `length` tokens at positions prefix .. prefix + length - 1 of one sequence
    whose first `prefix` positions are forwarded by another run (a packed stream's completion after its group's
    prompt: (prompt length, loss tokens); its prompt: (0, prompt length); a padded row: (0, real prompt + loss
    tokens)); head_tokens: positions through the LM head (the loss tokens)."""

    segments: tuple[tuple[int, int], ...]
    head_tokens: int

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.segments)

    def attention_pairs(self, window: int | None = None) -> int:
        return sum(causal_pairs(p, n, window) for p, n in self.segments)


def lora_of(model) -> tuple[int, tuple[str, ...], bool] | None:
    """(rank, target leaf names, expert LoRA) of the trainable LoRA in `model`, from its parameter names
    (`<leaf>.lora_A.weight` [r, K]; an experts stack's `lora_A.<weight>` [E, r, K]); None without LoRA."""
    ranks, targets, experts = set(), set(), False
    for name, p in model.named_parameters():
        if ".lora_A." not in f".{name}" or not p.requires_grad:
            continue
        owner = name.rpartition("lora_A.")[0]
        leaf = owner.rstrip(".").rpartition(".")[2]
        if p.ndim == 3:  # an experts stack's [E, r, K]
            experts = True
            ranks.add(p.shape[1])
        else:
            targets.add(leaf)
            ranks.add(p.shape[0])
    if not ranks:
        return None
    return max(ranks), tuple(sorted(targets)), experts


@dataclass(frozen=True)
class _Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    windows: tuple[int | None, ...]  # per layer
    sparse: tuple[bool, ...]  # per layer: an MoE block
    experts: int = 0
    top_k: int = 0
    expert_width: int = 0
    shared_width: int = 0  # Qwen2-MoE's shared expert (0: none)


def _windows(config, layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(window if types[i] == "sliding_attention" else None for i in range(layers))
    return (window,) * layers


def model_shape(config) -> _Shape | None:
    """What the count reads from an HF config; None for a mixture of experts it does not know."""
    g = lambda key, default=None: getattr(config, key, default)  # noqa: E731
    hidden, layers, heads = g("hidden_size"), g("num_hidden_layers"), g("num_attention_heads")
    shape = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=g("num_key_value_heads") or heads,
                 head_dim=g("head_dim") or hidden // heads, intermediate=g("intermediate_size"),
                 vocab=g("vocab_size"), windows=_windows(config, layers), sparse=(False,) * layers)
    kind = g("model_type", "")
    if kind in ("qwen2_moe", "qwen3_moe"):
        step, dense_only = g("decoder_sparse_step", 1) or 1, set(g("mlp_only_layers", None) or ())
        sparse = tuple(i not in dense_only and g("num_experts", 0) > 0 and (i + 1) % step == 0
                       for i in range(layers))
        shape.update(sparse=sparse, experts=g("num_experts"), top_k=g("num_experts_per_tok"),
                     expert_width=g("moe_intermediate_size"), shared_width=g("shared_expert_intermediate_size", 0) or 0)
    elif kind == "gpt_oss":
        shape.update(sparse=(True,) * layers, experts=g("num_local_experts"), top_k=g("num_experts_per_tok"),
                     expert_width=g("intermediate_size"))
    elif any(g(key, 0) for key in EXPERT_COUNT_KEYS):
        return None
    return _Shape(**shape)


class _Tally:
    """FLOPs by component, forward and backward."""

    def __init__(self):
        self.by = {}

    def add(self, component: str, forward: int, backward: int = 0) -> None:
        f, b = self.by.get(component, (0, 0))
        self.by[component] = (f + forward, b + backward)

    def linear(self, t: int, n: int, k: int, r: int, backward: bool, input_grad: bool, base: str = "base") -> bool:
        """y[t, n] = x[t, k] W^T (+ LoRA rank r): add its FLOPs; returns whether y needs a gradient."""
        self.add(base, 2 * t * n * k, 2 * t * n * k if backward and input_grad else 0)
        if r:
            lora_backward = 2 * t * r * (2 * n + k) + (2 * t * r * k if input_grad else 0)
            self.add("lora", 2 * t * r * (k + n), lora_backward if backward else 0)
        return input_grad or bool(r)


def pass_flops(config, layout: PassLayout, lora: tuple[int, tuple[str, ...], bool] | None, *,
               backward: bool) -> dict[str, tuple[int, int]] | None:
    """One pass's useful FLOPs by component -> {"base", "lora", "attention", "head", ("router", "experts")}:
    (forward, backward) each; None for a model the count does not know (`model_shape`).

    lora: (rank, target leaf names, expert LoRA) as `lora_of` gives it, or None (no LoRA, or LoRA disabled:
    the reference pass); backward: the pass also runs the backward (a loss pass)."""
    s = model_shape(config)
    if s is None:
        return None
    r, targets, expert_lora = lora if lora is not None else (0, (), False)
    rank = {name: r if name in targets else 0 for name in ATTENTION + MLP}
    t, tally = layout.tokens, _Tally()
    q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
    grad = False  # whether the residual stream needs a gradient: not the embedding output
    for i in range(s.layers):
        qkv = [tally.linear(t, n, s.hidden, rank[name], backward, grad)
               for name, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out))]
        # per pair and query head: Q K^T and P V forward, 2 head_dim each; backward dV, and dP (into the softmax)
        # with dQ and dK, each as much again, where q, k or v needs it
        product = 2 * s.head_dim * s.heads * layout.attention_pairs(s.windows[i])
        q, k, v = qkv
        tally.add("attention", 2 * product, product * (v + (q or k) + q + k) if backward else 0)
        grad |= tally.linear(t, s.hidden, q_out, rank["o_proj"], backward, any(qkv))
        if s.sparse[i]:
            tally.add("router", 2 * t * s.experts * s.hidden, 2 * t * s.experts * s.hidden if backward and grad else 0)
            routed, r_e = t * s.top_k, r if expert_lora else 0
            act = tally.linear(routed, 2 * s.expert_width, s.hidden, r_e, backward, grad, base="experts")
            tally.linear(routed, s.hidden, s.expert_width, r_e, backward, act, base="experts")
            if s.shared_width:  # a dense MLP beside the experts, and its 1-wide gate on the same input
                tally.add("base", 2 * t * s.hidden, 2 * t * s.hidden if backward and grad else 0)
                grad = _mlp(tally, t, s.hidden, s.shared_width, rank, backward, grad)
            grad |= bool(r_e)
        else:
            grad = _mlp(tally, t, s.hidden, s.intermediate, rank, backward, grad)
    head = 2 * layout.head_tokens * s.vocab * s.hidden
    tally.add("head", head, head if backward and grad else 0)
    return tally.by


def _mlp(tally: _Tally, t: int, hidden: int, width: int, rank: dict, backward: bool, grad: bool) -> bool:
    """A gated MLP (gate, up, down); returns whether the residual stream needs a gradient after it."""
    gate = tally.linear(t, width, hidden, rank["gate_proj"], backward, grad)
    up = tally.linear(t, width, hidden, rank["up_proj"], backward, grad)
    return grad | tally.linear(t, hidden, width, rank["down_proj"], backward, gate or up)


def total(by: dict[str, tuple[int, int]]) -> int:
    return sum(f + b for f, b in by.values())


def update_flops(config, layout: PassLayout, lora: tuple[int, tuple[str, ...], bool] | None, *, loss_passes: int,
                 old_logprob_pass: bool = False, reference_pass: bool = False) -> int | None:
    """The useful FLOPs of one update (module docstring): `loss_passes` forward + backward passes with LoRA, the
    no-grad old-log-prob pass with LoRA, the no-grad reference pass without; None for an unknown model."""
    loss = pass_flops(config, layout, lora, backward=True)
    if loss is None:
        return None
    forward = sum(f for f, _ in pass_flops(config, layout, lora, backward=False).values())
    reference = sum(f for f, _ in pass_flops(config, layout, None, backward=False).values())
    return loss_passes * total(loss) + old_logprob_pass * forward + reference_pass * reference
