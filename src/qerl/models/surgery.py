"""The surgery on linears: target `nn.Linear`s become frozen `QuantLinear`s (4-bit, or kept 16-bit as format bf16).

Siblings that serving engines fuse into one matmul (q/k/v, gate/up) share one global scale, the smallest of
theirs, so a fused weight has one divisor (`shared_global_scales`). Each dense weight is dropped as soon as its
layer is replaced. Used on a whole model (`convert.quantize_model`), one decoder layer at a time
(`calibrated_quantize`, the streaming loader) alike; LoRA is attached by the caller (`lora_attach`).
"""

from typing import Callable, Iterable

import torch
from rich.progress import Progress
from torch import nn

from ..formats import get_format
from ..nn import DEFAULT_TARGETS, LoraConfig, QuantLinear
from .calibrate import method_quantizer
from .lora_init import init_linear_lora_
from .targets import FUSED_GROUPS, find_targets, set_module


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


def replace_linears(model: nn.Module, fmt: str, lora: LoraConfig | None = None,
                    targets: Iterable[str] = DEFAULT_TARGETS,
                    quantizer: WeightQuantizer | None = None, show_progress: bool = False,
                    covariances: dict[str, torch.Tensor] | None = None) -> None:
    """The surgery itself: every target linear of `model` (a whole model or one block) becomes a QuantLinear
    whose tensors come from `quantizer` (default: the format's round-to-nearest with shared global scales).
    With `lora.init` loftq / eora the adapter is fitted to the residual while the 16-bit weight is still at hand
    (`lora_init`); eora reads `covariances` {name: input covariance fp32 [K, K]} (`calibrated_quantize`)."""
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
            if lora is not None and lora.init != "zero":
                if lora.init == "eora" and (covariances is None or name not in covariances):
                    raise ValueError(f"{name}: lora.init eora needs calibration text (the layer's input covariance); "
                                     "quantize through calibrated_quantize")
                init_linear_lora_(layer, lin.weight, None if covariances is None else covariances.get(name))
            set_module(model, name, layer)
            progress.advance(task)


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
    caller's (`lora_attach.add_lora_to`, after every quantized layer's), so the whole-model and the layer-by-layer
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
