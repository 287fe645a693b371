"""Model surgery for mixture-of-experts blocks: replace 3-D expert stacks by frozen 4-bit `QuantExperts`.

`quantize_model` swaps `nn.Linear` modules only; transformers 5 keeps MoE experts as 3-D parameters in an
`...Experts` module, which it would leave in 16 bits. `quantize_experts` handles those (`quantize_model` calls
it, after checking, before it changes anything, that it will succeed). Supported are the
classes whose layout and eager forward `QuantExperts` reproduces exactly (`SUPPORTED_EXPERTS`: Qwen3-MoE and
Qwen2-MoE, `gate_up_proj` [E, 2I, H] concatenated gate;up, `down_proj` [E, H, I], no bias); every other
`...Experts` module is refused before anything is changed (gpt-oss, for one, has biases, a transposed and
interleaved layout and a clamped activation). Qwen2-MoE's shared expert is a plain MLP of `nn.Linear`s and
goes through `quantize_model` like any other linear.
"""

import torch
from torch import nn

from ..formats import get_format
from ..nn.quant_experts import QuantExperts
from ..quant import check_method, quantize_group
from .convert import set_module

# classes whose forward is transformers' eager experts loop on this exact layout (checked in tests)
SUPPORTED_EXPERTS = ("Qwen3MoeExperts", "Qwen2MoeExperts")
# the methods that handle experts (the calibrated ones would need per-expert statistics: later work)
EXPERT_METHODS = ("rtn", "4over6")
# what transformers' `use_experts_implementation` decorator records about the layout, and the values we handle
_LAYOUT_FLAGS = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True,
                 "has_post_expert_norm": False}


def is_experts_module(module: nn.Module) -> bool:
    """An HF experts stack (class name ending in "Experts"), supported or not; never a QuantExperts."""
    return type(module).__name__.endswith("Experts") and not isinstance(module, QuantExperts)


def check_experts_layout(name: str, module: nn.Module) -> None:
    """Raise ValueError, naming the module, unless `module` is an experts stack QuantExperts reproduces."""
    cls = type(module).__name__
    where = f"{name or '<root>'} ({cls})"
    if cls not in SUPPORTED_EXPERTS:
        raise ValueError(f"experts module {where}: class not supported for 4-bit experts; supported: "
                         f"{', '.join(SUPPORTED_EXPERTS)} (3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I], "
                         "no bias)")
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"}:
        raise ValueError(f"experts module {where}: expected exactly the parameters gate_up_proj and down_proj, "
                         f"found {sorted(params)} (biases and other layouts are not supported)")
    if dict(module.named_buffers(recurse=False)):
        raise ValueError(f"experts module {where}: unexpected buffers {sorted(dict(module.named_buffers()))}")
    for flag, expected in _LAYOUT_FLAGS.items():
        if getattr(module, flag, expected) != expected:
            raise ValueError(f"experts module {where}: {flag}={getattr(module, flag)!r} is not supported "
                             f"(only {flag}={expected!r})")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3:
        raise ValueError(f"experts module {where}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} must be 3-D")
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(f"experts module {where}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]")
    if not callable(getattr(module, "act_fn", None)):
        raise ValueError(f"experts module {where}: has no act_fn")


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """[(name, module)] of every HF experts stack in `model` (supported or not), in module order."""
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


def check_experts(model: nn.Module, fmt: str, method: str = "rtn") -> list[tuple[str, nn.Module]]:
    """Raise ValueError unless `quantize_experts(model, fmt, method)` can work; changes nothing.

    Returns the experts stacks [(name, module)] that it would replace."""
    block = get_format(fmt).block
    if get_format(fmt).name == "bf16":
        raise ValueError("quantize_experts: fmt must be a 4-bit format (nvfp4, mxfp4, nf4), not bf16")
    check_method(method, fmt)
    if method not in EXPERT_METHODS:
        raise ValueError(f"quantize_experts: method {method!r} does not handle MoE experts yet; use "
                         f"{' or '.join(EXPERT_METHODS)}")
    found = experts_modules(model)
    for name, module in found:
        check_experts_layout(name, module)
        if not name:
            raise ValueError(f"quantize_experts: the model itself is an experts module ({type(module).__name__}); "
                             "pass the model that contains it")
        _, two_i, h = module.gate_up_proj.shape
        for weight, k in (("gate_up_proj", h), ("down_proj", two_i // 2)):
            if k % block:  # NF4's block runs over the flattened matrix; K % 64 is its conservative per-row rule
                raise ValueError(f"experts module {name} ({type(module).__name__}): {weight} has {k} input "
                                 f"features, not a multiple of the {fmt} block size {block}")
    return found


def _stack_method(fmt: str, method: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [E, N, K] -> stacked tensors, each expert's matrix quantized alone by `method` (own global scale)."""
    per_expert = [quantize_group(fmt, method, [weight[e].detach()])[0] for e in range(weight.shape[0])]
    return {name: torch.stack([t[name] for t in per_expert]) for name in per_expert[0]}


def quantize_experts(model: nn.Module, fmt: str = "nvfp4", method: str = "rtn") -> dict[str, QuantExperts]:
    """Replace every experts stack of `model` in place by a frozen `QuantExperts` in `fmt`; returns them by name.

    Every `...Experts` module is checked first (`check_experts`: `check_experts_layout`, and both input dims
    against the format's block size), so an unsupported one is refused with a ValueError before the model is
    touched. The stacks are quantized one at a time by `method`: round-to-nearest ("rtn"), or NVFP4's
    calibration-free scale search ("4over6"; each expert's fused gate_up and its down matrix each quantized
    as one group by `qerl.quant.quantize_group`); the calibrated methods do not handle experts yet. Each dense
    gate_up_proj / down_proj is dropped right after, so peak memory stays near one model copy. The result
    holds no parameters (no LoRA on experts yet). `quantize_model` calls this for models holding experts."""
    found = check_experts(model, fmt, method)
    replaced = {}
    for name, module in found:
        if method == "rtn":
            quant = QuantExperts.from_experts(module, fmt)
        else:
            e, two_i, h = module.gate_up_proj.shape
            with torch.no_grad():
                quant = QuantExperts(e, h, two_i // 2, fmt, module.act_fn,
                                     _stack_method(fmt, method, module.gate_up_proj),
                                     _stack_method(fmt, method, module.down_proj))
        set_module(model, name, quant)
        module.gate_up_proj = None  # free the 16-bit weights even where the caller still holds the old module
        module.down_proj = None
        replaced[name] = quant
    return replaced


@torch.no_grad()
def dequantize_experts_into(experts: nn.Module, quant: QuantExperts) -> None:
    """Copy `quant`'s dequantized weights into a dense HF experts module of the same shape (for comparisons)."""
    experts.gate_up_proj.copy_(quant.dequantized_gate_up(experts.gate_up_proj.dtype))
    experts.down_proj.copy_(quant.dequantized_down(experts.down_proj.dtype))
