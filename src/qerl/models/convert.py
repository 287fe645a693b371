"""Whole-model conversion: `quantize_model` swaps a causal LM's target linears for frozen quantized LoRA layers (and
its MoE experts stacks for 4-bit ones); `dequantize_model` goes back to dense modules.

Embeddings, norms and lm_head stay in 16 bits (opt-in: `embeddings=True` stores an untied input embedding
in the same 4-bit format as a `QuantEmbedding`). How codes and scales are chosen is the `method`
(`qerl.quant`): round-to-nearest by default, through the linear surgery (`surgery`); the calibrated methods
run the model layer by layer over calibration tokens (`calibration`). Everything is checked before the
model is changed. LoRA attachment is `lora_attach`; memory reports are `memory`.
"""

from typing import Iterable

import torch
from torch import nn

from ..formats import FORMATS, WeightFormat
from ..nn import DEFAULT_TARGETS, LoraConfig, QuantEmbedding
from ..nn.quant_embedding import check_embedding_shape
from ..quant import CALIBRATED
from .calibration import calibrated_quantize
from .experts import experts_to_quantize, replace_experts
from .lora_attach import add_expert_lora, add_lora_to, check_expert_lora_possible
from .precision import names_under, resolve_checked_keep_bf16
from .quantization import Quantization
from .surgery import WeightQuantizer, quantize_keeping
from .targets import quant_embeddings, quant_layers


def quantize_model(
    model: nn.Module,
    fmt: str | WeightFormat = "nvfp4",
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
    need `calibration`, token ids int64 [S, T] (`qerl.models.calibration.calibration_ids`), and a whole HF
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
    q = Quantization.of(fmt, method, targets=targets, keep_bf16=keep_bf16, embeddings=embeddings, lora=lora,
                        calibration=calibration)
    return quantize_as(model, q, quantizer=quantizer, show_progress=show_progress, name_prefix=name_prefix,
                       experts=experts)


def quantize_as(model: nn.Module, q: Quantization, *, quantizer: WeightQuantizer | None = None,
                show_progress: bool = False, name_prefix: str = "", experts: bool = True) -> nn.Module:
    """`quantize_model` with its settings resolved and checked once (`Quantization`); in place, returns `model`."""
    fmt, method, lora = q.format, q.method, q.lora
    with_experts = experts and experts_to_quantize(model, fmt, method, q.keep_bf16, name_prefix)
    if lora is not None and lora.experts:
        check_expert_lora_possible(model, with_experts)
        if lora.init == "eora":
            raise ValueError("lora.init eora: not with expert LoRA (lora.experts) yet (each expert's routed inputs "
                             "are not collected); use lora.init loftq")
    keep = resolve_checked_keep_bf16(model, q.keep_bf16, q.targets, name_prefix) if q.keep_bf16 else set()
    if q.embeddings:
        check_input_embeddings_quantizable(model, fmt)
    if q.calibrated:
        if q.calibration is None:
            what = f"quantization method {method!r}" if method in CALIBRATED else "lora.init eora"
            raise ValueError(f"{what} needs calibration token ids [S, T] "
                             "(qerl.models.calibration.calibration_ids)")
        if quantizer is not None:
            raise ValueError(f"a custom quantizer cannot be combined with the calibrated method {method!r}")
        calibrated_quantize(model, q, show_progress=show_progress,
                            keep={name_prefix + n for n in names_under(keep, name_prefix)})
    else:
        kept = quantize_keeping(model, q, names_under(keep, name_prefix), quantizer, show_progress)
        add_lora_to(kept, lora)
    if with_experts:
        replace_experts(model, fmt, method, fit=lora)
        if lora is not None and lora.experts:
            add_expert_lora(model, lora)
    if q.embeddings:
        quantize_input_embeddings(model, fmt)
    if hasattr(model, "config"):  # a whole HF model (a single block can be quantized too)
        model.config.qerl_weight_format = fmt.name
    return model


def input_embeddings_tied(model: nn.Module) -> bool:
    """True when lm_head shares the input embedding's table (same tensor, or the config ties them)."""
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    w, e = getattr(out, "weight", None), getattr(emb, "weight", None)
    same = w is not None and e is not None and (w is e or (
        w.device.type != "meta" and w.untyped_storage().data_ptr() == e.untyped_storage().data_ptr()))
    return same or bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def check_input_embeddings_quantizable(model: nn.Module, fmt: WeightFormat) -> None:
    """Raise ValueError unless `quantize_input_embeddings(model, fmt)` can work; changes nothing."""
    if not hasattr(model, "get_input_embeddings"):
        raise ValueError(f"{type(model).__name__} has no input embedding (get_input_embeddings) to quantize")
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        return
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"input embedding is a {type(emb).__name__}, not an nn.Embedding; cannot quantize it")
    if fmt.name == "bf16":
        raise ValueError("quantized embeddings need a 4-bit format (nvfp4, mxfp4, nf4); format bf16 keeps them 16-bit")
    if input_embeddings_tied(model):
        raise ValueError(
            "the input embedding is tied to lm_head (one shared table, as in SmolLM2): quantizing it would "
            "need lm_head to use the 4-bit table too, but the loss and the rollout read `model.lm_head.weight` "
            "as a dense matrix. Quantized embeddings are for untied models (e.g. Qwen2.5-7B); leave the option off"
        )
    check_embedding_shape(emb.num_embeddings, emb.embedding_dim, fmt)


def quantize_input_embeddings(model: nn.Module, fmt: WeightFormat = FORMATS["nvfp4"]) -> QuantEmbedding:
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


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every QuantLinear by a dense nn.Linear holding its dequantized base (LoRA dropped), in place.

    For interoperability (e.g. loading a qerl adapter with `peft` on the exact base qerl trained on).
    A `QuantEmbedding` becomes an nn.Embedding holding its dequantized table, in `dtype` or else its lookup
    dtype (the table the quantized model actually looked up).
    """
    for name, emb in quant_embeddings(model).items():
        model.set_submodule(name, emb.to_embedding(dtype))
    for name, layer in quant_layers(model).items():
        weight = layer.dequantized_weight(dtype or torch.float32)
        dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(weight)
            if layer.bias is not None:
                dense.bias.copy_(layer.bias)
        model.set_submodule(name, dense)
    if hasattr(model.config, "qerl_weight_format"):
        del model.config.qerl_weight_format
    return model
