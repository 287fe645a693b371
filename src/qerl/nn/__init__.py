"""Layers: the quantized LoRA linear and its LoRA settings; the opt-in quantized input embedding."""

from .lora import DEFAULT_TARGETS, LoraConfig
from .quant_embedding import QuantEmbedding
from .quant_linear import QuantLinear

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "QuantEmbedding", "QuantLinear"]
