"""Model surgery: swap a causal LM's target linears for frozen quantized LoRA layers.

Embeddings, norms and lm_head stay in 16 bits (opt-in: `embeddings=True` stores an untied input embedding
in the same 4-bit format as a `QuantEmbedding`). Siblings that serving engines fuse into one matmul
(q/k/v, gate/up) share one global scale, the smallest of theirs, so a fused weight has one divisor.
How codes and scales are chosen is the `method` (`qerl.quant`): round-to-nearest by default; the calibrated
methods run the model layer by layer over calibration tokens (`calibrated_quantize`).
"""

from typing import Callable, Iterable

import torch
from rich.progress import Progress
from torch import nn

from ..formats import get_format
from ..nn import DEFAULT_TARGETS, LoraConfig, QuantEmbedding, QuantLinear
from ..nn.quant_embedding import check_embedding_shape
from ..nn.quant_experts import QuantExperts
from ..quant import CALIBRATED, check_method
from ..quant.awq import FOLDED_SCALES, apply_awq
from .calibrate import (awq_fake_quant, calibration_compute_dtype, capture_layer_inputs, computing_in, layer_output,
                        layer_statistics, method_quantizer, sibling_groups)
from .precision import LAST, check_keep_bf16, names_under, resolve_keep_bf16
from .precision import _matches as matches_pattern  # keep_bf16 pattern semantics (a module selects its insides)
from .targets import FUSED_GROUPS, find_targets

# (module name, weight [N, K], shared global scale | None) -> format tensors. Round-to-nearest by default.
WeightQuantizer = Callable[[str, torch.Tensor, "torch.Tensor | None"], dict]


def shared_global_scales(linears: dict[str, nn.Linear], fmt: str) -> dict[str, torch.Tensor]:
    """{module path: fp32 [1]} for formats with a global scale: the minimum over each fused group."""
    scale_of = get_format(fmt).global_scale
    if scale_of is None:
        return {}
    scales = {name: scale_of(lin.weight) for name, lin in linears.items()}
    for name in linears:
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        group = next((g for g in FUSED_GROUPS if leaf in g), None)
        if group is None:
            continue
        siblings = [f"{parent}.{s}" if parent else s for s in group]
        scales[name] = torch.stack([scales[s] for s in siblings if s in scales]).amin(0)
    return scales


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at dotted `path` (e.g. `model.layers.0.mlp.up_proj`) by `module`."""
    parent_path, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, leaf, module)


def quantize_model(
    model: nn.Module,
    fmt: str = "nvfp4",
    lora: LoraConfig | None = None,
    targets: Iterable[str] = DEFAULT_TARGETS,
    quantizer: WeightQuantizer | None = None,
    show_progress: bool = False,
    embeddings: bool = False,
    method: str = "rtn",
    calibration: torch.Tensor | None = None,
    keep_bf16: Iterable[str] = (),
    name_prefix: str = "",
    experts: bool = True,
) -> nn.Module:
    """Replace the target linears of `model` in place by `QuantLinear` (frozen base + optional LoRA).

    All remaining parameters are frozen; only LoRA weights keep requires_grad. Each dense weight is
    dropped as soon as its layer is quantized, so peak memory stays near one model copy.
    method: how codes and scales are chosen (`qerl.quant.METHODS`: rtn, 4over6, gptq, awq); gptq and awq
    need `calibration`, token ids int64 [S, T] (`qerl.models.calibrate.calibration_ids`), and a whole HF
    causal LM. quantizer: a custom per-weight quantizer instead of the method's (rtn / 4over6 only).
    embeddings=True also stores the input embedding in `fmt` (`quantize_input_embeddings`; untied models
    only, checked before anything is changed), always round-to-nearest.
    keep_bf16: module names / patterns / "last:N" (`qerl.models.precision`) of targets left in 16 bits as
    QuantLinear("bf16") with the same LoRA; resolved against `name_prefix` + each target's name (pass
    "model.layers.3." when `model` is that block), checked before anything is changed.
    experts: also replace the model's MoE experts stacks (transformers' 3-D `...Experts` modules) by frozen
    `QuantExperts` in `fmt` (`qerl.models.experts.quantize_experts`; expert LoRA on them only with
    `lora.experts`, `add_expert_lora`), quantized by `method`
    (rtn or 4over6; a custom `quantizer` applies to the linears only); False leaves them dense (and frozen).
    Refused before anything is changed: an unsupported experts layout, gptq / awq on a model with experts
    (unless experts=False), and a keep_bf16 pattern that names an experts module. Format bf16 leaves them dense.
    """
    check_method(method, fmt)
    targets = tuple(targets)  # read more than once
    with_experts = experts and _check_experts_quantizable(model, fmt, method, keep_bf16, name_prefix)
    if lora is not None and lora.experts:
        _check_expert_lora_possible(model, with_experts)
    keep = resolve_keep_bf16(model, keep_bf16, targets, name_prefix) if keep_bf16 else set()
    if embeddings:
        check_input_embeddings_quantizable(model, fmt)
    if method in CALIBRATED:
        if calibration is None:
            raise ValueError(f"quantization method {method!r} needs calibration token ids [S, T] "
                             "(qerl.models.calibrate.calibration_ids)")
        if quantizer is not None:
            raise ValueError(f"a custom quantizer cannot be combined with the calibrated method {method!r}")
        calibrated_quantize(model, fmt, method, calibration, lora, targets, show_progress=show_progress,
                            keep={name_prefix + n for n in names_under(keep, name_prefix)})
    else:
        kept = quantize_keeping(model, fmt, lora, targets, names_under(keep, name_prefix), quantizer, method,
                                show_progress)
        add_lora_to(kept, lora)
    if with_experts:
        from .experts import quantize_experts

        quantize_experts(model, fmt, method)
        if lora is not None and lora.experts:
            add_expert_lora(model, lora)
    if embeddings:
        quantize_input_embeddings(model, fmt)
    if hasattr(model, "config"):  # a whole HF model (a single block can be quantized too)
        model.config.qerl_weight_format = fmt
    return model


def _check_expert_lora_possible(model: nn.Module, with_experts: bool) -> None:
    """ValueError, before anything is changed, when `quantize_model` could not put `lora.experts` LoRA on the
    experts of `model`: it has none, they stay dense (format bf16, experts=False), or their layout has no
    expert LoRA (gpt-oss)."""
    from .experts import LAYOUTS, experts_modules

    if not with_experts:
        raise ValueError(f"lora.experts: {type(model).__name__} gets no 4-bit MoE experts (QuantExperts) to put LoRA "
                         "on (not a Qwen3-MoE / Qwen2-MoE model, a bf16 format, or experts left dense)")
    other = [f"{n} ({type(m).__name__})" for n, m in experts_modules(model)
             if LAYOUTS[type(m).__name__].quant is not QuantExperts]
    if other:
        raise ValueError(f"lora.experts: expert LoRA covers the Qwen3-MoE / Qwen2-MoE experts layout only, not "
                         f"{other[0]}; turn lora.experts off")


def _check_experts_quantizable(model: nn.Module, fmt: str, method: str, keep_bf16: Iterable[str],
                               name_prefix: str) -> bool:
    """True when `quantize_model` is to quantize experts stacks of `model` (it holds some, fmt is 4-bit);
    ValueError, before anything is changed, where it could not."""
    from .experts import check_experts, experts_modules

    found = experts_modules(model)
    if not found or get_format(fmt).name == "bf16":
        return False
    if method in CALIBRATED:
        raise ValueError(f"quantization method {method!r}: gptq/awq do not handle MoE experts yet; use rtn or "
                         f"4over6, or experts=False ({type(model).__name__} holds {len(found)} experts modules, "
                         f"e.g. {found[0][0]})")
    for spec in check_keep_bf16(keep_bf16):
        if spec.startswith(LAST):  # last:N selects target linears only; the experts there stay 4-bit
            continue
        hit = next((name_prefix + n for n, _ in found if matches_pattern(name_prefix + n, spec)), None)
        if hit is not None:
            raise ValueError(f"keep_bf16 entry {spec!r} matches the MoE experts module {hit}: keeping experts in "
                             "16 bits is not supported; narrow the pattern to linears, or pass experts=False to "
                             "leave every experts module dense")
    check_experts(model, fmt, method)
    return True


def keep_dense_linears(model: nn.Module, names: Iterable[str]) -> dict[str, QuantLinear]:
    """Swap the named nn.Linear of `model` (names relative to it) for frozen QuantLinear("bf16") without
    LoRA, in place; {name: layer}. The base is the weight in bf16 ([N, K]; a bf16 weight is kept as is)."""
    dense = get_format("bf16")
    kept = {}
    for name in names:
        lin = model.get_submodule(name)
        kept[name] = QuantLinear(lin.in_features, lin.out_features, "bf16", dense.quantize(lin.weight), lin.bias)
        set_module(model, name, kept[name])
    return kept


def quantize_keeping(model: nn.Module, fmt: str, lora: LoraConfig | None, targets: Iterable[str],
                     keep: Iterable[str] = (), quantizer: WeightQuantizer | None = None, method: str = "rtn",
                     show_progress: bool = False) -> dict[str, QuantLinear]:
    """`replace_linears` (rtn / 4over6) with the targets named in `keep` (relative to `model`) left 16-bit.

    The kept linears become QuantLinear("bf16") first, so the quantizer never sees them and the quantized
    siblings left in a q/k/v or gate/up group share one global scale among themselves. Their LoRA is the
    caller's (`add_lora_to`, after every quantized layer's), so the whole-model and the layer-by-layer
    paths draw LoRA inits in the same order. Returns the kept layers by name."""
    targets, keep = tuple(targets), set(keep)
    names = find_targets(model, targets)
    unknown = sorted(keep - names.keys())
    if unknown:
        raise ValueError(f"keep_bf16: {unknown[:3]} are not target linears of {type(model).__name__}")
    kept = keep_dense_linears(model, [n for n in names if n in keep])
    for p in model.parameters():  # replace_linears freezes too, but is skipped when every target is kept
        p.requires_grad_(False)
    if len(kept) < len(names):
        if quantizer is None and method != "rtn":
            quantizer = method_quantizer(model, fmt, method, targets)
        replace_linears(model, fmt, lora, targets, quantizer, show_progress)
    return kept


def add_lora_to(layers: dict[str, QuantLinear], lora: LoraConfig | None) -> None:
    """Attach fresh LoRA adapters (trainable) to `layers`, in their order; nothing when lora is None."""
    if lora is not None:
        for layer in layers.values():
            layer.add_lora(lora)


def replace_linears(model: nn.Module, fmt: str, lora: LoraConfig | None = None, targets: Iterable[str] = DEFAULT_TARGETS,
                    quantizer: WeightQuantizer | None = None, show_progress: bool = False) -> None:
    """The surgery itself: every target linear of `model` (a whole model or one block) becomes a QuantLinear
    whose tensors come from `quantizer` (default: the format's round-to-nearest with shared global scales)."""
    spec = get_format(fmt)
    linears = find_targets(model, targets)
    for name, lin in linears.items():
        if lin.in_features % spec.block:
            raise ValueError(
                f"{name}: {lin.in_features} input features is not a multiple of the {fmt} block size "
                f"{spec.block}; leave this module out of --targets or choose another format"
            )
    scales = shared_global_scales(linears, fmt)
    for p in model.parameters():
        p.requires_grad_(False)
    with Progress(disable=not show_progress, transient=True) as progress:
        task = progress.add_task(f"quantizing to {fmt}", total=len(linears))
        for name, lin in linears.items():
            gs = scales.get(name)
            try:
                tensors = quantizer(name, lin.weight, gs) if quantizer else spec.quantize(lin.weight, gs)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            layer = QuantLinear(lin.in_features, lin.out_features, fmt, tensors, lin.bias, lora)
            set_module(model, name, layer)
            progress.advance(task)


@torch.no_grad()
def calibrated_quantize(model: nn.Module, fmt: str, method: str, ids: torch.Tensor, lora: LoraConfig | None = None,
                        targets: Iterable[str] = DEFAULT_TARGETS, device=None, fill=None,
                        show_progress: bool = False, keep: Iterable[str] = ()) -> dict:
    """Quantize every decoder layer of an HF causal LM with a calibrated method (gptq, awq), in order.

    ids: int64 [S, T] calibration tokens. Per layer (`qerl.models.calibrate`): its inputs' Hessians and row
    samples from the dense layer; AWQ folds its scales; the layer is quantized; the quantized layer makes
    the next layer's inputs, so later layers absorb earlier layers' error. fill(module, prefix): materialise
    each decoder layer from the meta device first (the streaming loader; the embedding and rotary module
    must be real already). keep: full names of targets left 16-bit (`keep_bf16`); AWQ still folds into them
    (exact), they are just not rounded. Returns {"tokens", "awq_scales": {module path: s fp32 [K]}}."""
    check_method(method, fmt)
    if method not in CALIBRATED:
        raise ValueError(f"{method!r} needs no calibration; use quantize_model(method={method!r})")
    targets = list(targets)
    device = torch.device(device or next(p.device for p in model.parameters() if not p.is_meta))
    compute = calibration_compute_dtype(device)
    body = model.model
    awq_scales = {}
    with Progress(disable=not show_progress, transient=True) as progress:
        batches = capture_layer_inputs(model, ids, device, compute)
        task = progress.add_task(f"calibrating + quantizing to {fmt} ({method})", total=len(body.layers))
        for i, layer in enumerate(body.layers):
            prefix = f"model.layers.{i}."
            if fill is not None:
                fill(layer, prefix)
            with computing_in(layer, compute):
                awq_scales.update(_calibrate_layer(layer, prefix, fmt, method, lora, targets, keep, batches, ids,
                                                   device))
                batches = [(layer_output(layer, h, kw), kw) for h, kw in batches]
            progress.advance(task)
    for name, p in model.named_parameters():  # embeddings, norms, lm_head: frozen as in the rtn path
        p.requires_grad_(".lora_" in name)
    if awq_scales:  # adapters of this model are saved / loaded as adapters of the unfolded model
        setattr(model, FOLDED_SCALES, awq_scales)
    return {"tokens": ids.numel(), "awq_scales": awq_scales}


def _calibrate_layer(layer: nn.Module, prefix: str, fmt: str, method: str, lora: LoraConfig | None, targets: list[str],
                     keep: Iterable[str], batches, ids: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """One decoder layer of `calibrated_quantize`: statistics, AWQ folding, quantization, in place.
    Returns this layer's AWQ scales {full module path: s fp32 [K]} (empty for gptq)."""
    kept_here = names_under(set(keep), prefix)
    names = [n for n in find_targets(layer, targets) if n not in kept_here]
    leaders = [g[0] for g in sibling_groups(names)]  # siblings share their input: one Hessian each
    # gptq: the Hessians; awq: row samples (it rounds without a Hessian: the folded weights see scaled inputs)
    hessians, samples = layer_statistics(layer, leaders, batches, ids.numel(), hessians=method == "gptq",
                                         samples=method == "awq")
    awq_scales = {}
    if method == "awq":
        leaf_samples = {n.rpartition(".")[2]: s.to(device) for n, s in samples.items()}
        for name, s in apply_awq(layer, leaf_samples, awq_fake_quant(fmt)).items():
            awq_scales[prefix + name] = s
    kept = keep_dense_linears(layer, sorted(kept_here))
    if names:
        replace_linears(layer, fmt, lora, targets, method_quantizer(layer, fmt, method, targets, hessians))
    add_lora_to(kept, lora)
    return awq_scales


def input_embeddings_tied(model: nn.Module) -> bool:
    """True when lm_head shares the input embedding's table (same tensor, or the config ties them)."""
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    w, e = getattr(out, "weight", None), getattr(emb, "weight", None)
    same = w is not None and e is not None and (w is e or (
        w.device.type != "meta" and w.untyped_storage().data_ptr() == e.untyped_storage().data_ptr()))
    return same or bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def check_input_embeddings_quantizable(model: nn.Module, fmt: str) -> None:
    """Raise ValueError unless `quantize_input_embeddings(model, fmt)` can work; changes nothing."""
    if not hasattr(model, "get_input_embeddings"):
        raise ValueError(f"{type(model).__name__} has no input embedding (get_input_embeddings) to quantize")
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        return
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"input embedding is a {type(emb).__name__}, not an nn.Embedding; cannot quantize it")
    if get_format(fmt).name == "bf16":
        raise ValueError("quantized embeddings need a 4-bit format (nvfp4, mxfp4, nf4); format bf16 keeps them 16-bit")
    if input_embeddings_tied(model):
        raise ValueError(
            "the input embedding is tied to lm_head (one shared table, as in SmolLM2): quantizing it would "
            "need lm_head to use the 4-bit table too, but the loss and the rollout read `model.lm_head.weight` "
            "as a dense matrix. Quantized embeddings are for untied models (e.g. Qwen2.5-7B); leave the option off"
        )
    check_embedding_shape(emb.num_embeddings, emb.embedding_dim, get_format(fmt).name)


def quantize_input_embeddings(model: nn.Module, fmt: str = "nvfp4") -> QuantEmbedding:
    """Replace the (untied) input embedding by a frozen `QuantEmbedding` in `fmt`, in place; returns it.

    Idempotent: an embedding that is already a QuantEmbedding is kept as it is (whatever its format).
    The dense table is dropped once quantized. Tied embeddings (lm_head sharing the table) are refused.
    """
    check_input_embeddings_quantizable(model, fmt)
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        return emb
    q = QuantEmbedding.from_embedding(emb, fmt)
    model.set_input_embeddings(q)
    return q


def quant_embeddings(model: nn.Module) -> dict[str, QuantEmbedding]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantEmbedding)}


def quant_experts(model: nn.Module) -> dict[str, QuantExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantExperts)}


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def add_lora(model: nn.Module, lora: LoraConfig) -> None:
    """Attach fresh LoRA adapters to every quantized layer whose leaf name is in lora.targets, and with
    lora.experts to every 4-bit experts stack (`add_expert_lora`; without it any expert LoRA is removed)."""
    layers = {n: m for n, m in quant_layers(model).items() if n.rsplit(".", 1)[-1] in lora.targets}
    if not layers:
        raise ValueError(f"no quantized layer matches LoRA targets {lora.targets}")
    if lora.experts:
        check_expert_lora(model)
    for layer in layers.values():
        layer.add_lora(lora)
    if lora.experts:
        add_expert_lora(model, lora)
    else:
        for m in quant_experts(model).values():
            m.remove_lora()


def check_expert_lora(model: nn.Module) -> dict[str, QuantExperts]:
    """The 4-bit experts stacks of `model` {name: QuantExperts}, if expert LoRA can go on every one of them;
    ValueError otherwise (none at all, or a layout without expert LoRA: gpt-oss's GptOssQuantExperts)."""
    experts = quant_experts(model)
    if not experts:
        raise ValueError(f"lora.experts: {type(model).__name__} has no 4-bit MoE experts (QuantExperts: Qwen3-MoE / "
                         "Qwen2-MoE quantized to nvfp4, mxfp4 or nf4) to put LoRA on; turn lora.experts off")
    other = [f"{n} ({type(m).__name__})" for n, m in experts.items() if type(m) is not QuantExperts]
    if other:
        raise ValueError(f"lora.experts: expert LoRA covers the Qwen3-MoE / Qwen2-MoE experts layout only, not "
                         f"{other[0]}; turn lora.experts off")
    return experts


def add_expert_lora(model: nn.Module, lora: LoraConfig) -> dict[str, QuantExperts]:
    """Attach fresh trainable expert LoRA (`QuantExperts.add_lora`: A [E, r, K], B [E, N, r] for gate_up and
    down) to every 4-bit experts stack of `model`, in module order; returns them. Checked first
    (`check_expert_lora`), so a model it does not fit is refused before any stack changes."""
    experts = check_expert_lora(model)
    for m in experts.values():
        m.add_lora(lora)
    return experts


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{state-dict name: parameter} of every LoRA weight (the trainable state of the policy)."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def memory_report(model: nn.Module) -> dict[str, float]:
    """Bytes held by the model (parameters + buffers), split into the quantized base, the rest, and LoRA.

    `base_bytes_per_param` counts every stored byte of the quantized layers (codes, scales, global
    scales, biases) per base weight they represent. A quantized input embedding (`QuantEmbedding`) is part
    of the quantized base: its V x D entries and its bytes are included. Layers kept in 16 bits beside 4-bit
    ones (`keep_bf16`) are counted apart, `kept_bf16_params` / `kept_bf16_bytes`, so that
    `base_bytes_per_param` stays the 4-bit format's figure; in an all-bf16 model (format bf16) they are the base.
    4-bit MoE experts (`QuantExperts`) are quantized base too: E x (2I x H + H x I) weights and their buffers.
    """
    layers = quant_layers(model)
    experts = list(quant_experts(model).values())
    four_bit = bool(experts) or any(m.weight_format != "bf16" for m in layers.values())
    kept = [m for m in layers.values() if four_bit and m.weight_format == "bf16"]
    base = [m for m in layers.values() if not (four_bit and m.weight_format == "bf16")]
    embeds = list(quant_embeddings(model).values())
    q_bytes = _buffer_bytes([*base, *embeds, *experts])
    q_params = (sum(m.in_features * m.out_features for m in base)
                + sum(m.num_embeddings * m.embedding_dim for m in embeds)
                + sum(m.num_experts * 3 * m.intermediate_dim * m.hidden_dim for m in experts))
    kept_bytes = _buffer_bytes(kept)
    lora = sum(p.numel() * p.element_size() for p in lora_parameters(model).values())
    # parameters() and buffers() each skip duplicates, so tied embeddings count once.
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {
        "quantized_params": q_params,
        "quantized_bytes": q_bytes,
        "base_bytes_per_param": q_bytes / max(q_params, 1),
        "kept_bf16_params": sum(m.in_features * m.out_features for m in kept),
        "kept_bf16_bytes": kept_bytes,
        "lora_bytes": lora,
        "other_bytes": total - q_bytes - kept_bytes - lora,
        "total_bytes": total,
    }


def _buffer_bytes(modules: Iterable[nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in m.buffers())


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every QuantLinear by a dense nn.Linear holding its dequantized base (LoRA dropped), in place.

    For interoperability (e.g. loading a qerl adapter with `peft` on the exact base qerl trained on).
    A `QuantEmbedding` becomes an nn.Embedding holding its dequantized table, in `dtype` or else its lookup
    dtype (the table the quantized model actually looked up).
    """
    for name, emb in quant_embeddings(model).items():
        set_module(model, name, emb.to_embedding(dtype))
    for name, layer in quant_layers(model).items():
        weight = layer.dequantized_weight(dtype or torch.float32)
        dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(weight)
            if layer.bias is not None:
                dense.bias.copy_(layer.bias)
        set_module(model, name, dense)
    if hasattr(model.config, "qerl_weight_format"):
        del model.config.qerl_weight_format
    return model
