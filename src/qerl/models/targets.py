"""Which linears of a model are quantization targets, and which of them serving engines fuse.

Shared by the surgery (`convert`), the calibration (`calibrate`) and the loaders."""

from typing import Iterable

from torch import nn

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
