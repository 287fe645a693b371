"""Layers: the quantized LoRA linear and its LoRA settings."""

from .lora import DEFAULT_TARGETS, LoraConfig
from .quant_linear import QuantLinear

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "QuantLinear"]
