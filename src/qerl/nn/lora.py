"""LoRA hyper-parameters and the adapter init used by PEFT (so exported adapters mean the same thing)."""

import math
from dataclasses import dataclass, field

import torch
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    r: int = 32
    alpha: float = 64.0
    dropout: float = 0.0
    use_rslora: bool = False  # scaling alpha/sqrt(r) instead of alpha/r
    targets: tuple[str, ...] = field(default_factory=lambda: DEFAULT_TARGETS)
    # also per-expert LoRA on the 4-bit MoE experts (`QuantExperts.add_lora`); needs dropout 0
    experts: bool = False

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        self.targets = tuple(self.targets)
        if not self.targets:
            raise ValueError("LoRA needs at least one target module name")
        if self.experts and self.dropout > 0:  # PEFT's ParamWrapper (the adapter format) refuses it as well
            raise ValueError(f"LoRA on MoE experts (experts: true) needs dropout 0, got {self.dropout}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def init_lora_(lora_A: nn.Linear, lora_B: nn.Linear) -> None:
    """PEFT's default: A Kaiming-uniform (a=sqrt(5)), B zero, so the adapter starts as the identity."""
    nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5))
    nn.init.zeros_(lora_B.weight)


def lora_hidden(x: torch.Tensor, lora_A: nn.Linear, dropout: nn.Module) -> torch.Tensor:
    """x [..., K] -> A(dropout(x)) [..., r] in x.dtype: the fp32 master A is cast to x's dtype so the matmul runs
    in the activation precision while the optimizer keeps fp32 weights. The B product, with the scaling, is
    added inside the base matmul (`quant_linear._QuantizedMatmul`)."""
    return torch.nn.functional.linear(dropout(x), lora_A.weight.to(x.dtype))
