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
    reader = check_gguf(path)
    kwargs = dict(gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kwargs)
    check_architecture(model.config, path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    tokenizer = with_gguf_special_tokens(tokenizer, gguf_special_tokens(reader.fields))
    # The weights are dense now: forget the GGUF quantizer so the model saves and trains like any other.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    return to_device(model, device), tokenizer


# GGUF token types (llama.cpp's llama_token_type): control (<|im_end|>) and user-defined tokens are the added
# special tokens of the HF tokenizer; "unused" ones are the [PAD151665]-style fillers up to the embedding's rows
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


def gguf_special_tokens(fields) -> dict:
    """What a GGUF file (its `GGUFReader(path).fields`) says of its special tokens: {"eos": str | None, "pad": str |
    None, "special": [str]}, the names of its end-of-sequence and padding tokens and of every control or
    user-defined token, in id order."""
    if "tokenizer.ggml.tokens" not in fields:
        return {"eos": None, "pad": None, "special": []}
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in fields else []

    def named(key):
        i = fields[key].contents() if key in fields else None
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    return {"eos": named("tokenizer.ggml.eos_token_id"), "pad": named("tokenizer.ggml.padding_token_id"),
            "special": [t for t, kind in zip(tokens, types) if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]}


def with_gguf_special_tokens(tokenizer, special: dict):
    """`tokenizer` with the GGUF's special tokens: its control tokens as added special tokens (they keep their ids:
    each is in the vocabulary already) and its eos and pad tokens. Why: transformers' GGUF tokenizer conversion
    differs between versions; 5.17 keeps 3 of Qwen2.5's 22 control tokens as special and takes `<|endoftext|>` for
    eos where the file says `<|im_end|>`, which tools that read the tokenizer's eos (Unsloth's pad check, TRL's
    completion mask) then see, while 5.25 reads both as the file has them."""
    from tokenizers import AddedToken

    have = {str(t) for t in tokenizer.added_tokens_decoder.values()}
    missing = [t for t in special["special"] if t not in have]
    if missing:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    for role in ("eos", "pad"):
        if special[role] is not None and getattr(tokenizer, f"{role}_token") != special[role]:
            setattr(tokenizer, f"{role}_token", special[role])
    return tokenizer


def to_device(model: nn.Module, device) -> nn.Module:
    return model.to(device) if device is not None else model
