"""Load a causal LM from an embedded name, a local HF directory, a GGUF file, a hub id, or a quantized
(compressed-tensors / bitsandbytes-NF4) directory written by qerl or llm-compressor.

Every failure names the file and the problem; nothing here runs code from a model directory unless
`trust_remote_code=True` is passed.
"""

import json
from pathlib import Path

import torch
from torch import nn

from . import registry

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class ModelLoadError(ValueError):
    """A model source that cannot be loaded; the message names the file and the problem."""


def _check_architecture(config, source) -> None:
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
    without AMX/AVX512-BF16 run ~100x slower than float32 (2048x576 @ 576x1536 on 2 AVX2 cores: 2.9 s vs
    0.023 s, torch 2.13); any other name as `resolve_dtype`."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    return resolve_dtype(dtype)


def check_gguf(path: Path) -> None:
    """Parse the GGUF header and tensor table; a truncated or corrupt file raises ModelLoadError."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = reader.fields.get("general.architecture")
        if arch is None or not reader.tensors:
            raise ValueError("no architecture field or no tensors")
    except Exception as e:  # the gguf reader raises many types on bad bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


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


def load_gguf(path, dtype=None, device=None):
    """A GGUF file -> (plain bf16 HF model with dense weights, tokenizer). Dequantizes GGUF blocks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    check_gguf(path)
    kwargs = dict(gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=resolve_dtype(dtype), **kwargs)
    _check_architecture(model.config, path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    # The weights are dense now: forget the GGUF quantizer so the model saves and trains like any other.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    return _to(model, device), tokenizer


# what a hub snapshot needs for streaming: weights, config, generation config and tokenizer files
HUB_PATTERNS = ("*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken")


def plain_hf_directory(name_or_path) -> Path | None:
    """The directory of the 16-bit Hugging Face checkpoint that `name_or_path` names, when qerl can stream it
    (`models.stream`): an embedded name, a local directory, or a hub id (its safetensors snapshot is
    downloaded into the Hugging Face cache first). None for anything else -- GGUF, quantized directories,
    unsupported architectures, a hub id that cannot be fetched -- which `load_causal_lm` handles or refuses
    with its own message."""
    source = str(name_or_path)
    if source in registry.EMBEDDED:
        path = registry.embedded_hf_dir(source)
    else:
        path = Path(source).expanduser()
        if not path.exists() and _looks_like_hub_id(source):
            path = _hub_snapshot(source)
            if path is None:
                return None
    if not (path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        return None
    config = _read_config(path)
    if config.get("quantization_config") or config.get("model_type") not in SUPPORTED_ARCHITECTURES:
        return None
    return path


def _looks_like_hub_id(source: str) -> bool:
    return source.count("/") == 1 and not source.startswith((".", "/", "~")) and not source.endswith(".gguf")


def _hub_snapshot(repo_id: str) -> Path | None:
    """Download (or find in the cache) the files of `repo_id` needed to stream it; None when that fails."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_PATTERNS)))
    except Exception:  # offline, unknown repo, gated...: load_causal_lm tries again and explains
        return None


def _to(model: nn.Module, device) -> nn.Module:
    return model.to(device) if device is not None else model


def _read_config(directory: Path) -> dict:
    try:
        return json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{directory / 'config.json'}: invalid JSON ({e})") from None


def load_causal_lm(name_or_path, dtype=None, device=None, trust_remote_code: bool = False):
    """Resolve a model source and return (model, tokenizer); quantized directories come back quantized.

    name_or_path: an embedded name (`smollm2-135m-instruct`), a GGUF file, a directory (HF, quantized
    HF, or holding one GGUF), or a hub id such as `Qwen/Qwen2.5-7B-Instruct` (needs network).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(name_or_path)
    if source in registry.EMBEDDED:
        path = registry.embedded_hf_dir(source)
    else:
        path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be a .gguf; otherwise pass its directory")
        return load_gguf(path, dtype, device)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return load_gguf(ggufs[0], dtype, device)
            raise ModelLoadError(
                f"{path}: neither a Hugging Face model directory (no config.json) nor a directory with one .gguf file"
            )
        config = _read_config(path)
        if config.get("model_type") not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: unknown architecture {config.get('model_type')!r}; "
                f"qerl supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        check_safetensors(path)
        if config.get("quantization_config"):
            from .checkpoint import load_quantized

            return load_quantized(path, dtype, device)
        local = True
    elif source.startswith((".", "/", "~")) or Path(source).suffix == ".gguf":
        raise ModelLoadError(f"{source}: no such file or directory")
    else:
        local = False  # a hub id
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path) if local else source, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path) if local else source, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ModelLoadError(f"{source}: could not load ({e})") from None
    _check_architecture(model.config, source)
    return _to(model, device), tokenizer


