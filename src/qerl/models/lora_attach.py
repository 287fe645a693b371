"""LoRA attachment: fresh trainable adapters on the quantized layers of a model, and on its 4-bit MoE experts.

Dense LoRA goes on `QuantLinear`s (`QuantLinear.add_lora`: A [r, K], B [N, r], PEFT's names); expert LoRA
(`lora.experts`) on the Qwen3-MoE / Qwen2-MoE experts stacks (`QuantExperts.add_lora`: A [E, r, K],
B [E, N, r]). `lora_parameters` names the trainable state of the policy.
"""

from torch import nn

from ..nn import LoraConfig, QuantExperts, QuantLinear
from .experts import LAYOUTS, experts_modules
from .lora_init import PENDING_FACTORS, set_expert_factors_
from .targets import quant_experts, quant_layers


def add_lora_to(layers: dict[str, QuantLinear], lora: LoraConfig | None) -> None:
    """Attach fresh LoRA adapters (trainable) to `layers`, in their order; nothing when lora is None."""
    if lora is not None:
        for layer in layers.values():
            layer.add_lora(lora)


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
    if lora.init != "zero":  # loftq: the factors `quantize_experts(fit=lora)` left on each stack
        missing = [n for n, m in experts.items() if getattr(m, PENDING_FACTORS, None) is None]
        if lora.init == "eora" or missing:
            raise ValueError(f"lora.init {lora.init}: expert LoRA starts from the residual fit only with loftq, "
                             "computed while quantizing (quantize_experts(fit=lora)); "
                             f"{'eora on experts is not supported yet' if lora.init == 'eora' else missing[0]}")
    for m in experts.values():
        m.add_lora(lora)
        factors = getattr(m, PENDING_FACTORS, None)
        if factors is not None:
            if lora.init == "loftq":
                set_expert_factors_(m, factors)
            delattr(m, PENDING_FACTORS)
    return experts


def check_expert_lora_possible(model: nn.Module, with_experts: bool) -> None:
    """ValueError, before anything is changed, when `quantize_model` could not put `lora.experts` LoRA on the
    experts of `model`: it has none, they stay dense (format bf16, experts=False), or their layout has no
    expert LoRA (gpt-oss)."""
    if not with_experts:
        raise ValueError(f"lora.experts: {type(model).__name__} gets no 4-bit MoE experts (QuantExperts) to put LoRA "
                         "on (not a Qwen3-MoE / Qwen2-MoE model, a bf16 format, or experts left dense)")
    other = [f"{n} ({type(m).__name__})" for n, m in experts_modules(model)
             if LAYOUTS[type(m).__name__].quant is not QuantExperts]
    if other:
        raise ValueError(f"lora.experts: expert LoRA covers the Qwen3-MoE / Qwen2-MoE experts layout only, not "
                         f"{other[0]}; turn lora.experts off")


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{state-dict name: parameter} of every LoRA weight (the trainable state of the policy)."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
