"""Model surgery for mixture-of-experts blocks: replace 3-D expert stacks by frozen 4-bit `QuantExperts`.

`quantize_model` swaps `nn.Linear` modules only; transformers 5 keeps MoE experts as 3-D parameters in an
`...Experts` module, which it would leave in 16 bits. `quantize_experts` handles those (`quantize_model` calls
it, after checking, before it changes anything, that it will succeed). Supported are the
classes whose layout and eager forward a qerl module reproduces exactly (`LAYOUTS`):
- Qwen3-MoE and Qwen2-MoE -> `QuantExperts`: `gate_up_proj` [E, 2I, H] concatenated gate;up, `down_proj`
  [E, H, I], no bias;
- gpt-oss -> `GptOssQuantExperts`: `gate_up_proj` [E, H, 2I] transposed with gate/up interleaved,
  `down_proj` [E, I, H], a bias on each, a clamped SwiGLU.
Every other `...Experts` module is refused before anything is changed. Qwen2-MoE's shared expert is a plain
MLP of `nn.Linear`s and goes through `quantize_model` like any other linear; gpt-oss's router
(`mlp.router`, weight + bias) is not a linear target and stays 16-bit and frozen.
"""

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from ..formats import WeightFormat, get_format
from ..nn.quant_experts import QuantExperts
from ..nn.quant_experts_gpt_oss import GptOssQuantExperts
from ..nn import LoraConfig
from ..quant import CALIBRATED, check_method, quantize_weights
from .lora_init import PENDING_FACTORS, expert_residual_factors
from .precision import refuse_kept_experts


@dataclass(frozen=True)
class ExpertsLayout:
    """What an HF experts class must hold for `quant` to replace it: exactly `params`, and the layout flags
    transformers' `use_experts_implementation` decorator records, with these values."""

    quant: type
    params: tuple[str, ...]
    flags: dict
    describe: str


_QWEN = ExpertsLayout(QuantExperts, ("gate_up_proj", "down_proj"),
                      {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True,
                       "has_post_expert_norm": False},
                      "3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I], no bias")
_GPT_OSS = ExpertsLayout(GptOssQuantExperts, ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
                         {"has_bias": True, "is_transposed": True, "is_concatenated": False, "has_gate": True,
                          "has_post_expert_norm": False},
                         "gpt-oss: gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H], biases")
# classes whose forward is transformers' eager experts loop on this exact layout (checked in tests)
LAYOUTS = {"Qwen3MoeExperts": _QWEN, "Qwen2MoeExperts": _QWEN, "GptOssExperts": _GPT_OSS}
SUPPORTED_EXPERTS = tuple(LAYOUTS)
# the methods that handle experts (the calibrated ones would need per-expert statistics: later work)
EXPERT_METHODS = ("rtn", "4over6")


def is_experts_module(module: nn.Module) -> bool:
    """An HF experts stack (class name ending in "Experts"), supported or not; never a QuantExperts."""
    return type(module).__name__.endswith("Experts") and not isinstance(module, QuantExperts)


def check_experts_layout(name: str, module: nn.Module) -> None:
    """Raise ValueError, naming the module, unless `module` is an experts stack QuantExperts reproduces."""
    cls = type(module).__name__
    where = f"{name or '<root>'} ({cls})"
    if cls not in LAYOUTS:
        raise ValueError(f"experts module {where}: class not supported for 4-bit experts; supported: "
                         + "; ".join(f"{c} ({layout.describe})" for c, layout in LAYOUTS.items()))
    layout = LAYOUTS[cls]
    params = dict(module.named_parameters(recurse=False))
    if set(params) != set(layout.params):
        raise ValueError(f"experts module {where}: expected exactly the parameters {', '.join(layout.params)}, "
                         f"found {sorted(params)} (biases and other layouts are not supported)")
    if dict(module.named_buffers(recurse=False)):
        raise ValueError(f"experts module {where}: unexpected buffers {sorted(dict(module.named_buffers()))}")
    for flag, expected in layout.flags.items():
        if getattr(module, flag, expected) != expected:
            raise ValueError(f"experts module {where}: {flag}={getattr(module, flag)!r} is not supported "
                             f"(only {flag}={expected!r})")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3:
        raise ValueError(f"experts module {where}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} must be 3-D")
    try:
        layout.quant.hf_dims(module)
    except ValueError as e:
        raise ValueError(f"experts module {where}: {str(e).partition(': ')[2]}") from None
    if layout.quant is QuantExperts and not callable(getattr(module, "act_fn", None)):
        raise ValueError(f"experts module {where}: has no act_fn")


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """[(name, module)] of every HF experts stack in `model` (supported or not), in module order."""
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


def check_experts(model: nn.Module, fmt: str | WeightFormat, method: str = "rtn") -> list[tuple[str, nn.Module]]:
    """Raise ValueError unless `quantize_experts(model, fmt, method)` can work; changes nothing.

    Returns the experts stacks [(name, module)] that it would replace."""
    fmt = get_format(fmt)
    check_method(method, fmt)
    return _checked_experts(model, fmt, method)


def _checked_experts(model: nn.Module, fmt: WeightFormat, method: str) -> list[tuple[str, nn.Module]]:
    block = fmt.block
    if fmt.name == "bf16":
        raise ValueError("quantize_experts: fmt must be a 4-bit format (nvfp4, mxfp4, nf4), not bf16")
    if method not in EXPERT_METHODS:
        raise ValueError(f"quantize_experts: method {method!r} does not handle MoE experts yet; use "
                         f"{' or '.join(EXPERT_METHODS)}")
    found = experts_modules(model)
    for name, module in found:
        check_experts_layout(name, module)
        if not name:
            raise ValueError(f"quantize_experts: the model itself is an experts module ({type(module).__name__}); "
                             "pass the model that contains it")
        _, h, i = LAYOUTS[type(module).__name__].quant.hf_dims(module)
        for weight, k in (("gate_up_proj", h), ("down_proj", i)):
            if k % block:  # NF4's block runs over the flattened matrix; K % 64 is its conservative per-row rule
                raise ValueError(f"experts module {name} ({type(module).__name__}): {weight} has {k} input "
                                 f"features, not a multiple of the {fmt.name} block size {block}")
    return found


def experts_to_quantize(model: nn.Module, fmt: WeightFormat, method: str, keep_bf16: Iterable[str] = (),
                        name_prefix: str = "") -> bool:
    """True when `quantize_model` is to quantize experts stacks of `model` (it holds some, fmt is 4-bit);
    ValueError, before anything is changed, where it could not: a calibrated method, a stack `check_experts`
    refuses, a keep_bf16 entry that names an experts module (`precision.refuse_kept_experts`)."""
    found = experts_modules(model)
    if not found or fmt.name == "bf16":
        return False
    if method in CALIBRATED:
        raise ValueError(f"quantization method {method!r}: gptq/awq do not handle MoE experts yet; use rtn or "
                         f"4over6, or experts=False ({type(model).__name__} holds {len(found)} experts modules, "
                         f"e.g. {found[0][0]})")
    _checked_experts(model, fmt, method)
    refuse_kept_experts([name_prefix + n for n, _ in found], keep_bf16)
    return True


def _stack_method(fmt: WeightFormat, method: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [E, N, K] -> stacked tensors, each expert's matrix quantized alone by `method` (own global scale)."""
    per_expert = [quantize_weights(fmt, method, [weight[e].detach()])[0] for e in range(weight.shape[0])]
    return {name: torch.stack([t[name] for t in per_expert]) for name in per_expert[0]}


def _with_method(quant_cls: type, module: nn.Module, fmt: WeightFormat, method: str) -> QuantExperts:
    """`quant_cls` built from `module` with each expert's matrices ([N, K], qerl's orientation) quantized by
    `method`."""
    e, h, i = quant_cls.hf_dims(module)
    gpt_oss = quant_cls is GptOssQuantExperts  # stores [E, K, N]: each expert's matrix transposed first
    gate_up, down = (_stack_method(fmt, method, w.transpose(1, 2) if gpt_oss else w)
                     for w in (module.gate_up_proj, module.down_proj))
    if gpt_oss:
        return GptOssQuantExperts(e, h, i, fmt, module.alpha, module.limit, gate_up, down,
                                  module.gate_up_proj_bias.detach().clone(), module.down_proj_bias.detach().clone())
    return QuantExperts(e, h, i, fmt, module.act_fn, gate_up, down)


def quantize_experts(model: nn.Module, fmt: str | WeightFormat = "nvfp4", method: str = "rtn",
                     fit: LoraConfig | None = None) -> dict[str, QuantExperts]:
    """Replace every experts stack of `model` in place by a frozen `QuantExperts` in `fmt`; returns them by name.

    Every `...Experts` module is checked first (`check_experts`: `check_experts_layout`, and both input dims
    against the format's block size), so an unsupported one is refused with a ValueError before the model is
    touched. The stacks are quantized one at a time by `method`: round-to-nearest ("rtn"), or NVFP4's
    calibration-free scale search ("4over6"; each expert's fused gate_up and its down matrix each quantized
    as one group by `qerl.quant.quantize_group`); the calibrated methods do not handle experts yet. Each dense
    gate_up_proj / down_proj is dropped right after, so peak memory stays near one model copy. The result
    holds no parameters (no LoRA on experts yet). `quantize_model` calls this for models holding experts.
    fit: a LoraConfig with experts and init loftq: each stack's residual factors are computed before its 16-bit
    weights go and kept on it until `add_expert_lora` (`lora_init.PENDING_FACTORS`)."""
    fmt = get_format(fmt)
    check_method(method, fmt)
    return replace_experts(model, fmt, method, fit)


def replace_experts(model: nn.Module, fmt: WeightFormat, method: str = "rtn",
                    fit: LoraConfig | None = None) -> dict[str, QuantExperts]:
    """`quantize_experts` for a format and method already checked together (`Quantization.of`)."""
    found = _checked_experts(model, fmt, method)
    replaced = {}
    for name, module in found:
        quant_cls = LAYOUTS[type(module).__name__].quant
        if method == "rtn":
            quant = quant_cls.from_experts(module, fmt)
        else:
            with torch.no_grad():
                quant = _with_method(quant_cls, module, fmt, method)
        if fit is not None and fit.experts and fit.init == "loftq" and type(quant) is QuantExperts:
            dense = {"gate_up_proj": module.gate_up_proj, "down_proj": module.down_proj}
            setattr(quant, PENDING_FACTORS, expert_residual_factors(quant, dense, fit.r, fit.scaling))
        model.set_submodule(name, quant)
        module.gate_up_proj = None  # free the 16-bit weights even where the caller still holds the old module
        module.down_proj = None
        replaced[name] = quant
    return replaced


@torch.no_grad()
def dequantize_experts_into(experts: nn.Module, quant: QuantExperts) -> None:
    """Copy `quant`'s dequantized weights (and gpt-oss's biases) into a dense HF experts module of the same
    shape, in that module's layout (for comparisons)."""
    for name, tensor in quant.dequantized_hf(torch.float32).items():
        getattr(experts, name).copy_(tensor)
