"""LoRA hyper-parameters and the adapter init used by PEFT (so exported adapters mean the same thing).

`LoraConfig` and `DEFAULT_TARGETS` are defined in `qerl.lora_config` (torch-free, so the training config can
import them) and re-exported here."""

import math

import torch
from torch import nn

from ..lora_config import DEFAULT_TARGETS, LoraConfig  # noqa: F401 (re-exported)


def init_lora_(lora_A: nn.Linear, lora_B: nn.Linear) -> None:
    """PEFT's default: A Kaiming-uniform (a=sqrt(5)), B zero, so the adapter starts as the identity."""
    nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5))
    nn.init.zeros_(lora_B.weight)


def lora_hidden(x: torch.Tensor, lora_A: nn.Linear, dropout: nn.Module) -> torch.Tensor:
    """x [..., K] -> A(dropout(x)) [..., r] in x.dtype: the fp32 master A is cast to x's dtype so the matmul runs
    in the activation precision while the optimizer keeps fp32 weights. The B product, with the scaling, is
    added inside the base matmul (`quant_linear._QuantizedMatmul`)."""
    return torch.nn.functional.linear(dropout(x), lora_A.weight.to(x.dtype))
