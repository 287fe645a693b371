"""A GGUF file -> a plain 16-bit Hugging Face model (transformers dequantizes the GGUF blocks)."""

from pathlib import Path

import torch
from torch import nn

from .sources import ModelLoadError, check_architecture, check_gguf


def load_gguf(path, dtype: torch.dtype = torch.bfloat16, device=None):
    """A GGUF file -> (plain HF model with dense weights in `dtype`, tokenizer). Dequantizes GGUF blocks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    check_gguf(path)
    kwargs = dict(gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kwargs)
    check_architecture(model.config, path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    # The weights are dense now: forget the GGUF quantizer so the model saves and trains like any other.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    return to_device(model, device), tokenizer


def to_device(model: nn.Module, device) -> nn.Module:
    return model.to(device) if device is not None else model
