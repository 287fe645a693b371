"""What a model source must satisfy before qerl loads it, and the dtypes it loads in: the supported
architectures, the error every loader raises, bounds-checked safetensors and GGUF files, dtype names.
Loads nothing itself, so every loader (`load`, `gguf`, `checkpoint`, `stream`) can import it.
"""

import json
from pathlib import Path

import torch

DENSE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# mixtures of experts: loaded whole through transformers (which stacks a checkpoint's per-expert tensors into its
# 3-D experts modules), then quantized (`quantize_model(experts=True)`); never streamed layer by layer. gpt-oss's
# released checkpoints hold MXFP4 experts, which `gpt_oss.load_gpt_oss_mxfp4` keeps as they are
MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "gpt_oss")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES


class ModelLoadError(ValueError):
    """A model source that cannot be loaded; the message names the file and the problem."""


def check_architecture(config, source) -> None:
    """ModelLoadError unless the HF config's model_type is one qerl supports."""
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unknown architecture {config.model_type!r}; qerl supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def resolve_dtype(dtype) -> torch.dtype:
    """A dtype name ("bf16", "fp16", "fp32", their long names, "auto" = bf16) or torch.dtype -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(names)}")
    return names[dtype]


def compute_dtype(dtype, device) -> torch.dtype:
    """The dtype to compute in on `device`: "auto" is bf16 on a GPU and float32 on the CPU, where bf16 matmuls
    without AMX / AVX512-BF16 run far slower than float32 (compare with `model.dtype=bf16`); any other name
    as `resolve_dtype`."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    return resolve_dtype(dtype)


def check_gguf(path: Path):
    """Parse the GGUF header and tensor table and return the `gguf.GGUFReader`; a truncated or corrupt file raises
    ModelLoadError."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = reader.fields.get("general.architecture")
        if arch is None or not reader.tensors:
            raise ValueError("no architecture field or no tensors")
        return reader
    except Exception as e:  # the gguf reader raises many types on bad bytes
        # it reads by memory map: a file cut short fails as an index past the end or a tensor that cannot take
        # its shape from the bytes left
        if isinstance(e, IndexError) or "cannot reshape" in str(e):
            raise ModelLoadError(f"{path}: not a readable GGUF file: truncated ({path.stat().st_size} bytes; its "
                                 "header or tensor data go past the end: download or copy it again)") from None
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_config(directory: Path) -> dict:
    """A model directory's config.json; ModelLoadError naming the file when it is missing, unreadable or not
    valid JSON."""
    try:
        return json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{directory / 'config.json'}: invalid JSON ({e})") from None
    except OSError as e:
        raise ModelLoadError(f"{directory / 'config.json'}: unreadable ({e})") from None


def check_safetensors(directory: Path) -> list[Path]:
    """All *.safetensors in a directory, each opened and every tensor's bytes bounds-checked."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weight files (only safetensors is supported)")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    sf.get_slice(key)
        except Exception as e:
            raise ModelLoadError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    return files
