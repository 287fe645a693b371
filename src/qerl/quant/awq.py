"""AWQ (Lin et al., 2023): activation-aware per-input-channel scaling, folded into the dense layer.

For linears W_i [N_i, K] that read one input x [n, K], x W^T = (x / s) (W s)^T for any s > 0 [K]: the
weights are quantized as W s, so input channels with large activations (s_j > 1) are quantized on a
finer relative grid where it matters most for the output. s = mean|x|^alpha (normalised so that
max * min = 1), alpha chosen on a grid by the output error under the caller's fake quantization; alpha = 0
(s = 1) is always a candidate, so the search never does worse than plain quantization on its samples.

The 1/s is folded into whatever produces x, so nothing is added at run time:
  input_layernorm          -> q, k, v    norm.weight /= s, W *= s on columns
  post_attention_layernorm -> gate, up   likewise
  up_proj                  -> down_proj  up rows (and bias) /= s, down columns *= s
  v_proj                   -> o_proj     v rows (and bias) /= s, o columns *= s; only without GQA, where
                                         v's output channel j is o's input channel j
A norm folded this way carries s in a non-persistent buffer (`CHANNEL_SCALE`), which AQN reads so its
noise stays the noise of the unfolded norm (`qerl.nn.noisy_norm`). Checkpoints keep the folded weights; the
buffer travels beside them through `channel_scales` / `set_channel_scales`. LoRA adapters trained on the
folded layers convert to and from adapters of the unfolded model with `lora_between_bases`.

Norms must compute x * weight (Llama / Qwen2 / Qwen3 / Mistral RMSNorm), not x * (1 + weight).
"""

import warnings
from typing import Callable

import torch
from torch import nn

# fp32 [D] non-persistent buffer that apply_awq leaves on each norm it folded a channel scale into; AQN
# (`qerl.nn.noisy_norm`) reads it to draw that norm's noise in the unfolded units
CHANNEL_SCALE = "qerl_channel_scale"

FakeQuant = Callable[[list[torch.Tensor]], list[torch.Tensor]]

MAX_ROWS = 4096  # input rows the search uses (for mean|x| and for the error); callers may pass more
ACT_FLOOR = 1e-4  # mean|x| is clamped to this fraction of its maximum: dead channels get a small, finite s

# (producer, consumers reading its output); `inputs` is keyed by a consumer's leaf name
GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


# ------------------------------------------------------------------------------------------- search


def sample_rows(x: torch.Tensor, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """x [n, K] -> at most `max_rows` evenly strided rows (deterministic), finite rows only, fp32."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    x = x[torch.isfinite(x).all(dim=1)]
    if x.shape[0] > max_rows:
        x = x[torch.linspace(0, x.shape[0] - 1, max_rows, device=x.device).long()]
    return x


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """mean|x| per input channel, fp32 [K], floored at ACT_FLOOR * its maximum (all zeros -> all ones)."""
    act = x.abs().mean(dim=0)
    top = act.max()
    if not top > 0:
        return torch.ones_like(act)
    return act.clamp(min=float(top) * ACT_FLOOR)


def candidate_scale(act: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = act^alpha / sqrt(max * min), fp32 [K] > 0; alpha = 0 gives exactly ones."""
    if alpha == 0:
        return torch.ones_like(act)
    s = act.pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def output_error(weights: list[torch.Tensor], x: torch.Tensor, s: torch.Tensor, fake_quant: FakeQuant) -> float:
    """sum_i ||x W_i^T - (x / s) Q(W_i s)^T||^2 for fp32 W_i [N_i, K], x [n, K], s [K]; a Python float.

    Evaluated as ||x (W_i - Q(W_i s) / s)^T||^2: one product per weight, no cancellation of two large outputs."""
    deq = fake_quant([w * s for w in weights])
    total = 0.0
    for w, q in zip(weights, deq):
        total += float((x @ (w - q.float().to(w.device) / s).t()).pow(2).sum(dtype=torch.float64))
    return total


def awq_search(weights: list[torch.Tensor], x: torch.Tensor, fake_quant: FakeQuant,
               grid: int = 20) -> tuple[torch.Tensor, dict]:
    """The AWQ input scale for weights sharing one input.

    weights: [N_i, K] (any float dtype; searched in fp32); x: input rows [n, K] (at most MAX_ROWS are used);
    fake_quant(list of fp32 [N_i, K]) -> list of dequantized fp32 [N_i, K] (the caller's format and method,
    sibling global scale included). alpha runs over i / grid, i = 0..grid; ties go to the smaller alpha.
    A candidate alpha > 0 whose fake_quant raises is skipped (one warning for all), one with a non-finite
    error never wins; if alpha = 0 raises, the exception propagates (plain quantization would fail too).
    Returns (s fp32 [K] > 0 on the weights' device, {"alpha", "error", "error_unscaled"})."""
    ws = [w.detach().float() for w in weights]
    k = x.shape[-1]
    if not ws or any(w.ndim != 2 or w.shape[1] != k for w in ws):
        raise ValueError(f"awq_search: weights {[tuple(w.shape) for w in ws]} and input {tuple(x.shape)} "
                         "do not share one input width")
    x = sample_rows(x).to(ws[0].device)
    act = activation_scale(x)
    base = output_error(ws, x, torch.ones_like(act), fake_quant)
    best = (base, 0.0, torch.ones_like(act))
    failed = []
    for i in range(1, grid + 1):
        alpha = i / grid
        s = candidate_scale(act, alpha)
        try:
            err = output_error(ws, x, s, fake_quant)
        except Exception as e:  # noqa: BLE001 -- one bad candidate should not lose the others
            failed.append(f"alpha={alpha:g}: {type(e).__name__}: {e}")
            continue
        if err < best[0]:  # False for NaN: a non-finite error never wins
            best = (err, alpha, s)
    if failed:
        warnings.warn(f"awq_search: {len(failed)} scaled candidates failed to quantize, e.g. {failed[0]}",
                      stacklevel=2)
    err, alpha, s = best
    return s, {"alpha": alpha, "error": err, "error_unscaled": base}


# -------------------------------------------------------------------------------------------- folds


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # fold in fp32 at least (bf16 params), fp64 when the layer is fp64, then round once to the param dtype
    return torch.promote_types(t.dtype, torch.float32)


@torch.no_grad()
def _scale(t: torch.Tensor, s: torch.Tensor, dim: int, divide: bool) -> None:
    """t *= s (or /= s) broadcast along `dim` of t, in place, one rounding to t's dtype."""
    shape = [1] * t.ndim
    shape[dim] = -1
    f = s.to(t.device, _compute_dtype(t)).reshape(shape)
    wide = t.to(_compute_dtype(t))
    t.copy_(wide / f if divide else wide * f)


def scale_columns(linears: list[nn.Linear], s: torch.Tensor) -> None:
    """W [N, K] *= s [K] on input columns, in place; a bias is unchanged by input scaling."""
    for lin in linears:
        _scale(lin.weight.data, s, 1, divide=False)


def divide_outputs(module: nn.Module, s: torch.Tensor) -> None:
    """Output channel j of `module` divided by s_j: an RMSNorm's 1-D weight, or a linear's rows and bias."""
    _scale(module.weight.data, s, 0, divide=True)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        _scale(bias.data, s, 0, divide=True)


def record_channel_scale(norm: nn.Module, s: torch.Tensor) -> None:
    """Multiply `s` into the norm's non-persistent CHANNEL_SCALE buffer (fp32 [D]; created as s)."""
    old = getattr(norm, CHANNEL_SCALE, None)
    new = s.detach().float().to(norm.weight.device).clone()  # never alias the caller's tensor
    norm.register_buffer(CHANNEL_SCALE, new if old is None else old.float() * new, persistent=False)


def fold(producer: nn.Module, consumers: list[nn.Linear], s: torch.Tensor) -> None:
    """producer outputs /= s, consumer columns *= s: the composition is unchanged in exact arithmetic."""
    divide_outputs(producer, s)
    scale_columns(consumers, s)
    if not isinstance(producer, nn.Linear):
        record_channel_scale(producer, s)


# -------------------------------------------------------------------------------------------- layer


def _module(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _group_input(inputs: dict[str, torch.Tensor], consumers: tuple[str, ...]) -> torch.Tensor | None:
    for name in consumers:
        for key in (name, name.rpartition(".")[2]):
            if key in inputs:
                return inputs[key]
    return None


Group = tuple[str, nn.Module, list[nn.Linear], torch.Tensor]


def layer_groups(layer: nn.Module, inputs: dict[str, torch.Tensor]) -> list[Group]:
    """The foldable (producer name, producer, consumers, input rows [n, K]) of a decoder layer.

    A group is left out when a module or its input sample is missing, or for v -> o under GQA (v has fewer
    output channels than o has inputs)."""
    groups = []
    for producer_name, consumer_names in GROUPS:
        producer = _module(layer, producer_name)
        consumers = [_module(layer, n) for n in consumer_names]
        x = _group_input(inputs, consumer_names)
        if producer is None or any(c is None for c in consumers) or x is None:
            continue
        if isinstance(producer, nn.Linear) and producer.out_features != consumers[0].in_features:
            continue
        groups.append((producer_name, producer, consumers, x))
    return groups


@torch.no_grad()
def apply_awq(layer: nn.Module, inputs: dict[str, torch.Tensor], fake_quant: FakeQuant,
              grid: int = 20) -> dict[str, torch.Tensor]:
    """Search and fold AWQ scales into a dense HF decoder layer (Llama / Qwen2 / Qwen3 / Mistral), in place.

    inputs: {leaf name ("q_proj", "o_proj", "gate_proj", "down_proj", or any sibling's): input rows [n, K]}
    captured from this dense layer; fake_quant: as for `awq_search`. Every group is searched on the
    unchanged layer before any fold, so an exception leaves the layer untouched. Groups whose search
    keeps alpha = 0 are not folded. Returns {producer name relative to the layer ("input_layernorm",
    "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"): s fp32 [K]} for each fold applied;
    folded norms also record s in their CHANNEL_SCALE buffer (for AQN)."""
    found = []
    for name, producer, consumers, x in layer_groups(layer, inputs):
        s, info = awq_search([c.weight for c in consumers], x, fake_quant, grid)
        if info["alpha"] > 0:
            found.append((name, producer, consumers, s))
    for name, producer, consumers, s in found:
        fold(producer, consumers, s)
    return {name: s for name, _, _, s in found}


def folded_covariances(covariances: dict[str, torch.Tensor], folds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The input covariances of a layer's linears after `apply_awq` folded `folds` ({producer name: s [K]}, its
    return) into it: a consumer of a folded producer reads x / s, so its C [K, K] becomes diag(1/s) C diag(1/s).
    covariances: {linear name relative to the layer (a sibling group's leader): C fp32 [K, K]}, taken from the
    unfolded layer; others are returned unchanged."""
    out = dict(covariances)
    for producer, consumers in GROUPS:
        s = folds.get(producer)
        if s is None:
            continue
        inv = 1.0 / s.float()
        for name in consumers:
            if name in out:
                c = out[name]
                out[name] = c * inv.to(c.device)[:, None] * inv.to(c.device)[None, :]
    return out


# --------------------------------------------------------------------------------------- persistence


def channel_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """{module path: CHANNEL_SCALE fp32 [D]} for every module of `model` that carries one (the folded norms)."""
    return {name: getattr(m, CHANNEL_SCALE).detach().float().clone()
            for name, m in model.named_modules() if isinstance(getattr(m, CHANNEL_SCALE, None), torch.Tensor)}


def set_channel_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Register saved scales ({module path: fp32 [D]}) as CHANNEL_SCALE buffers, replacing any present.

    For a model whose norm weights were loaded already folded: nothing else changes. ValueError for a
    path that is not a module with a 1-D weight of D entries, or a scale that is not finite and positive."""
    for path, s in scales.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"AWQ channel scale for {path!r}: no such module in {type(model).__name__}") from None
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.ndim != 1:
            raise ValueError(f"AWQ channel scale for {path!r}: {type(module).__name__} has no 1-D weight")
        s = torch.as_tensor(s).detach()
        if s.shape != w.shape or not (torch.isfinite(s).all() and (s > 0).all()):
            raise ValueError(f"AWQ channel scale for {path!r}: need {tuple(w.shape)} finite positive values, "
                             f"got {tuple(s.shape)}")
        module.register_buffer(CHANNEL_SCALE, s.float().to(w.device).clone(), persistent=False)


# ------------------------------------------------------------------------------------- LoRA adapters


FOLDED_SCALES = "qerl_awq_scales"  # model attribute: {producer path: s fp32 [K]} of folds made in this process


def lora_between_bases(lora: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], to_original: bool
                       ) -> dict[str, torch.Tensor]:
    """LoRA weights trained on an AWQ-folded base <-> the same adapter for the unfolded (original) model.

    lora: {"<module path>.lora_A.weight": A [r, K], "<module path>.lora_B.weight": B [N, r]} (fp32 copies
    are returned, the input is not changed); scales: {producer path: s [K]} as `apply_awq` returns them,
    with the layer prefix (e.g. "model.layers.3.input_layernorm"). A consumer of a fold reads x / s on the
    folded base, so its A becomes A / s to read x (A * s the other way); a linear producer's output is
    divided by s there, so its B becomes s * B (B / s). Exact up to one fp32 rounding per element."""
    out = {k: v.detach().float().clone() for k, v in lora.items()}
    for path, s in scales.items():
        s = s.detach().float()
        for producer, consumers in GROUPS:
            if not path.endswith(producer):
                continue
            prefix = path[: len(path) - len(producer)]
            for consumer in consumers:
                key = f"{prefix}{consumer}.lora_A.weight"
                if key in out:
                    a = out[key]
                    out[key] = a / s.to(a.device) if to_original else a * s.to(a.device)
            key = f"{path}.lora_B.weight"
            if key in out:  # a linear producer (v_proj, up_proj) with its own adapter
                b = out[key]
                out[key] = b * s.to(b.device).unsqueeze(1) if to_original else b / s.to(b.device).unsqueeze(1)
            break
    return out

