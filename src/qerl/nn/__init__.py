"""Layers: the quantized LoRA linear and its LoRA settings; the opt-in quantized input embedding; frozen 4-bit MoE
experts."""

from .lora import DEFAULT_TARGETS, LoraConfig
from .quant_embedding import QuantEmbedding
from .quant_experts import QuantExperts
from .quant_linear import QuantLinear

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "QuantEmbedding", "QuantExperts", "QuantLinear"]
