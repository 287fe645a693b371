"""The surgery on linears: target `nn.Linear`s become frozen `QuantLinear`s (4-bit, or kept 16-bit as format bf16).

Siblings that serving engines fuse into one matmul (q/k/v, gate/up) share one global scale, the smallest of
theirs, so a fused weight has one divisor (`shared_global_scales`), and a method other than round-to-nearest
quantizes each such group together (`method_quantizer`). Each dense weight is dropped as soon as its layer is
replaced. Used on a whole model (`convert.quantize_model`) and one decoder layer at a time (`calibration`, the
layer-by-layer builder) alike; the targets are found once by the caller and handed in as {name: nn.Linear}.
LoRA is attached by the caller (`lora_attach`).
"""

from typing import Callable, Iterable

import torch
from rich.progress import Progress
from torch import nn

from ..formats import WeightFormat, get_format
from ..nn import LoraConfig, QuantLinear
from ..quant import NVFP4_SEARCH, quantize_weights
from .lora_init import init_linear_lora_
from .quantization import Quantization
from .targets import FUSED_GROUPS, find_targets


# (module name, weight [N, K], shared global scale | None) -> format tensors. Round-to-nearest by default.
WeightQuantizer = Callable[[str, torch.Tensor, "torch.Tensor | None"], dict]


def fused_siblings(name: str) -> list[str]:
    """Every name of `name`'s fused group (q/k/v or gate/up) under the same parent, in group order; [name]
    for a linear outside any group. They all read the same input."""
    parent, _, leaf = name.rpartition(".")
    group = next((g for g in FUSED_GROUPS if leaf in g), (leaf,))
    return [f"{parent}.{s}" if parent else s for s in group]


def sibling_groups(names: Iterable[str]) -> list[list[str]]:
    """Module names grouped as fused siblings (q/k/v, gate/up under one parent); others alone, in order."""
    names, groups, seen = list(names), [], set()
    for name in names:
        if name not in seen:
            members = [n for n in fused_siblings(name) if n in names]
            groups.append(members)
            seen.update(members)
    return groups


def shared_global_scales(linears: dict[str, nn.Linear], fmt: str | WeightFormat) -> dict[str, torch.Tensor]:
    """{module path: fp32 [1]} for formats with a global scale: the minimum over each fused group."""
    return _shared_global_scales(linears, get_format(fmt))


def _shared_global_scales(linears: dict[str, nn.Linear], fmt: WeightFormat) -> dict[str, torch.Tensor]:
    scale_of = fmt.global_scale
    if scale_of is None:
        return {}
    scales = {name: scale_of(lin.weight) for name, lin in linears.items()}
    for name in linears:
        group = fused_siblings(name)
        if len(group) > 1:
            scales[name] = torch.stack([scales[s] for s in group if s in scales]).amin(0)
    return scales


def method_quantizer(module: nn.Module, names: Iterable[str], fmt: WeightFormat, method: str,
                     hessians: dict[str, torch.Tensor] | None = None, search: str = NVFP4_SEARCH) -> WeightQuantizer:
    """A `replace_linears` quantizer that quantizes each sibling group among `names` (target linears of `module`,
    relative to it) together with `method`, already checked against `fmt` (`quant.check_method`).

    hessians: {module name: fp32 [K, K]} for gptq, keyed by any member of a group; search: the NVFP4 scale
    candidates (`nvfp4_scales.candidate_scales`)."""
    hessians = hessians or {}
    group_of = {n: g for g in sibling_groups(names) for n in g}
    done: dict[str, dict] = {}

    def quantize(name, weight, _shared_global_scale):
        if name not in done:  # the group's first member: the whole group, while its siblings are still dense
            group = group_of[name]
            ws = [module.get_submodule(n).weight.detach() for n in group]
            h = next((hessians[n] for n in fused_siblings(group[0]) if n in hessians), None)
            done.update(zip(group, quantize_weights(fmt, method, ws, h, name=group[0], search=search)))
        return done.pop(name)

    return quantize


def replace_linears(model: nn.Module, linears: dict[str, nn.Linear], fmt: WeightFormat,
                    lora: LoraConfig | None = None, quantizer: WeightQuantizer | None = None,
                    show_progress: bool = False, covariances: dict[str, torch.Tensor] | None = None) -> None:
    """The surgery itself: every linear of `linears` ({name relative to `model`: nn.Linear}, `find_targets`)
    becomes a QuantLinear whose tensors come from `quantizer` (default: the format's round-to-nearest with shared
    global scales). With `lora.init` loftq / eora the adapter is fitted to the residual while the 16-bit weight is
    still at hand (`lora_init`); eora reads `covariances` {name: input covariance fp32 [K, K]} (`calibration`)."""
    for name, lin in linears.items():
        if lin.in_features % fmt.block:
            raise ValueError(
                f"{name}: {lin.in_features} input features is not a multiple of the {fmt.name} block size "
                f"{fmt.block}; leave this module out of --targets or choose another format"
            )
    scales = _shared_global_scales(linears, fmt)
    for p in model.parameters():
        p.requires_grad_(False)
    with Progress(disable=not show_progress, transient=True) as progress:
        task = progress.add_task(f"quantizing to {fmt.name}", total=len(linears))
        for name, lin in linears.items():
            gs = scales.get(name)
            try:
                tensors = quantizer(name, lin.weight, gs) if quantizer else fmt.quantize(lin.weight, gs)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            layer = QuantLinear(lin.in_features, lin.out_features, fmt, tensors, lin.bias, lora)
            if lora is not None and lora.init != "zero":
                if lora.init == "eora" and (covariances is None or name not in covariances):
                    raise ValueError(f"{name}: lora.init eora needs calibration text (the layer's input covariance); "
                                     "quantize through calibrated_quantize")
                init_linear_lora_(layer, lin.weight, None if covariances is None else covariances.get(name))
            model.set_submodule(name, layer)
            progress.advance(task)


def keep_dense_linears(model: nn.Module, linears: dict[str, nn.Linear]) -> dict[str, QuantLinear]:
    """Swap `linears` ({name relative to `model`: nn.Linear}) for frozen QuantLinear("bf16") without LoRA, in place;
    {name: layer}. The base is the weight in bf16 ([N, K]; a bf16 weight is kept as is)."""
    dense = get_format("bf16")
    kept = {}
    for name, lin in linears.items():
        kept[name] = QuantLinear(lin.in_features, lin.out_features, dense, dense.quantize(lin.weight), lin.bias)
        model.set_submodule(name, kept[name])
    return kept


def quantize_keeping(model: nn.Module, q: Quantization, keep: Iterable[str] = (),
                     quantizer: WeightQuantizer | None = None, show_progress: bool = False) -> dict[str, QuantLinear]:
    """`replace_linears` (rtn / 4over6) on the targets `q.targets` of `model`, with those named in `keep` (relative
    to `model`) left 16-bit.

    The kept linears become QuantLinear("bf16") first, so the quantizer never sees them and the quantized
    siblings left in a q/k/v or gate/up group share one global scale among themselves. Their LoRA is the
    caller's (`lora_attach.add_lora_to`, after every quantized layer's), so the whole-model and the layer-by-layer
    paths draw LoRA inits in the same order. Returns the kept layers by name."""
    keep = set(keep)
    linears = find_targets(model, q.targets)
    unknown = sorted(keep - linears.keys())
    if unknown:
        raise ValueError(f"keep_bf16: {unknown[:3]} are not target linears of {type(model).__name__}")
    kept = keep_dense_linears(model, {n: lin for n, lin in linears.items() if n in keep})
    rest = {n: lin for n, lin in linears.items() if n not in keep}
    for p in model.parameters():  # replace_linears freezes too, but is skipped when every target is kept
        p.requires_grad_(False)
    if rest:
        if quantizer is None and q.method != "rtn":
            quantizer = method_quantizer(model, rest, q.format, q.method)
        replace_linears(model, rest, q.format, q.lora, quantizer, show_progress)
    return kept
