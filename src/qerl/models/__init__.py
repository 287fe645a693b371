"""Model I/O and surgery: load HF/GGUF/quantized models, quantize, save checkpoints and PEFT adapters."""

from .adapter import AdapterError, load_adapter, save_adapter
from .checkpoint import load_quantized, save_quantized
from .convert import dequantize_model, quantize_input_embeddings, quantize_model
from .experts import quantize_experts
from .pretrained import load_causal_lm
from .loader import ModelSpec, load_policy
from .lora_attach import add_lora, lora_parameters
from .memory import memory_report
from .quantization import Quantization
from .sources import ModelLoadError
from .registry import DEFAULT_MODEL, EMBEDDED
from .targets import quant_embeddings, quant_experts, quant_layers

__all__ = [
    "AdapterError", "DEFAULT_MODEL", "EMBEDDED", "ModelLoadError", "ModelSpec", "Quantization", "add_lora",
    "dequantize_model", "load_adapter", "load_causal_lm", "load_policy", "load_quantized", "lora_parameters",
    "memory_report", "quant_embeddings", "quant_experts", "quant_layers", "quantize_experts",
    "quantize_input_embeddings", "quantize_model", "save_adapter", "save_quantized",
]
