"""Where things sit in a model: which linears are quantization targets (and which of them serving engines fuse),
and the quantized modules once converted (a submodule is replaced by torch's `Module.set_submodule`).

Shared by the surgery (`surgery`, `convert`, `experts`), the calibration (`calibration`), LoRA attachment, the
memory report and the loaders."""

from typing import Iterable

from torch import nn

from ..nn import QuantEmbedding, QuantExperts, QuantLinear

# Leaf names that share one global scale when they sit under the same parent module.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def find_targets(model: nn.Module, targets: Iterable[str]) -> dict[str, nn.Linear]:
    """{module path: nn.Linear} for linears whose leaf name is in targets (lm_head never included)."""
    targets = set(targets)
    found = {
        name: mod for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in targets and name != "lm_head"
    }
    if not found:
        raise ValueError(
            f"none of the target modules {sorted(targets)} is an nn.Linear in {type(model).__name__}; "
            "check --targets against the model's module names"
        )
    return found


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """{module path: layer} of every QuantLinear in `model`, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def quant_experts(model: nn.Module) -> dict[str, QuantExperts]:
    """{module path: stack} of every 4-bit MoE experts stack (QuantExperts and its subclasses) in `model`."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantExperts)}


def quant_embeddings(model: nn.Module) -> dict[str, QuantEmbedding]:
    """{module path: embedding} of every QuantEmbedding in `model`."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantEmbedding)}
