"""Pretrained sources: an embedded name, a local HF directory, a GGUF file, a hub id, a quantized
(compressed-tensors / bitsandbytes-NF4) directory written by qerl or llm-compressor, or a gpt-oss directory
with MXFP4 experts as OpenAI released it (`gpt_oss`: the experts' codes and scales kept as stored).

`plain_hf_directory` names the 16-bit safetensors directory of a source that can be read one decoder layer at a
time (`stream.CheckpointLayers`); `load_causal_lm` loads any source whole: 16-bit modules, or the stored 4-bit
state of a quantized directory (`checkpoint`, `gguf`, `gpt_oss` do the reading).

Every failure names the file and the problem; nothing here runs code from a model directory unless
`trust_remote_code=True` is passed.
"""

import json
from pathlib import Path

import torch

from . import registry
from .checkpoint import load_quantized
from .gguf import load_gguf, to_device
from .gpt_oss import is_gpt_oss_mxfp4, load_gpt_oss_mxfp4
from .sources import (DENSE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelLoadError, check_architecture,
                      check_safetensors, read_config, resolve_dtype)

# what a hub snapshot needs for streaming: weights, config, generation config and tokenizer files
HUB_PATTERNS = ("*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken")


def _named_path(source: str) -> Path:
    """The local path a model name stands for: an embedded name's cached 16-bit directory (converted once), else
    the path as given; a near miss of an embedded name is refused first (`check_near_miss`)."""
    check_near_miss(source)
    return registry.embedded_hf_dir(source) if source in registry.EMBEDDED else Path(source).expanduser()


def plain_hf_directory(name_or_path) -> Path | None:
    """The directory of the 16-bit Hugging Face checkpoint that `name_or_path` names, when qerl can stream it
    (`models.stream`): an embedded name, a local directory, or a hub id (its safetensors snapshot is
    downloaded into the Hugging Face cache first). None for anything else -- GGUF, quantized directories,
    mixtures of experts, unsupported architectures, a hub id that cannot be fetched -- which `load_causal_lm`
    handles or refuses with its own message."""
    source = str(name_or_path)
    path = _named_path(source)
    if source not in registry.EMBEDDED:
        if not path.exists() and _looks_like_hub_id(source):
            path = _hub_snapshot(source)
            if path is None:
                return None
    if not (path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        return None
    config = read_config(path)
    if config.get("quantization_config") or config.get("model_type") not in DENSE_ARCHITECTURES:
        return None  # quantized, MoE (loaded whole: transformers restacks its experts) or unsupported
    return path


def check_near_miss(source: str) -> None:
    """ModelLoadError for a name that is no local path and no org/name hub id but close to an embedded name
    ("smollm2-135m"): the hub would be asked for it, with retries that cost minutes offline, and then refuse."""
    import difflib

    if source in registry.EMBEDDED or "/" in source or Path(source).expanduser().exists():
        return
    close = difflib.get_close_matches(source.lower(), registry.EMBEDDED, n=1, cutoff=0.6)
    if close:
        raise ModelLoadError(f"{source}: no such embedded model, file or directory; did you mean {close[0]!r}? "
                             f"(embedded: {', '.join(registry.EMBEDDED)}; hub ids are ORG/NAME)")


def is_quantized_checkpoint(name_or_path) -> bool:
    """Whether `name_or_path` is a local directory holding a quantized checkpoint (its config.json has a
    quantization_config), read without loading it; False for anything else (embedded names, hub ids, GGUF)."""
    config = Path(str(name_or_path)).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("quantization_config") is not None
    except ValueError:
        return False  # the loader reports the broken file


def _looks_like_hub_id(source: str) -> bool:
    return source.count("/") == 1 and not source.startswith((".", "/", "~")) and not source.endswith(".gguf")


def _hub_snapshot(repo_id: str) -> Path | None:
    """Download (or find in the cache) the files of `repo_id` needed to stream it; None when that fails."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_PATTERNS)))
    except Exception:  # offline, unknown repo, gated...: load_causal_lm tries again and explains
        return None


def _gpt_oss_mxfp4_snapshot(repo_id: str) -> Path | None:
    """The downloaded snapshot of hub repo `repo_id` when it is gpt-oss with MXFP4 experts (its config.json
    says so), for `load_gpt_oss_mxfp4`; None for anything else or when the hub cannot be reached (the caller's
    transformers path then tries, and explains)."""
    try:
        from huggingface_hub import hf_hub_download

        config = json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text())
    except Exception:  # offline, unknown or gated repo, bad JSON: not ours to report here
        return None
    return _hub_snapshot(repo_id) if is_gpt_oss_mxfp4(config) else None


def load_causal_lm(name_or_path, dtype=None, device=None, trust_remote_code: bool = False):
    """Resolve a model source and return (model, tokenizer); quantized directories come back quantized.

    name_or_path: an embedded name (`smollm2-135m-instruct`), a GGUF file, a directory (HF, quantized
    HF, or holding one GGUF), or a hub id such as `Qwen/Qwen2.5-7B-Instruct` (needs network).
    dtype: a torch.dtype or its name (`sources.resolve_dtype`; None: bf16).
    """
    return load_pretrained(name_or_path, resolve_dtype(dtype), device, trust_remote_code)


def load_pretrained(name_or_path, dtype: torch.dtype, device=None, trust_remote_code: bool = False):
    """`load_causal_lm` with the dtype resolved (the loader's compute dtype), handed to every loader below."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(name_or_path)
    path = _named_path(source)
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
        config = read_config(path)
        if config.get("model_type") not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: unknown architecture {config.get('model_type')!r}; "
                f"qerl supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        check_safetensors(path)
        if is_gpt_oss_mxfp4(config):  # gpt-oss as released: MXFP4 experts, kept bit for bit
            return load_gpt_oss_mxfp4(path, dtype, device)
        if config.get("quantization_config"):
            return load_quantized(path, dtype, device)
        local = True
    elif source.startswith((".", "/", "~")) or Path(source).suffix == ".gguf":
        raise ModelLoadError(f"{source}: no such file or directory")
    else:
        local = False  # a hub id
        snapshot = _gpt_oss_mxfp4_snapshot(source)
        if snapshot is not None:  # transformers would dequantize (CPU) or swap in its own kernels' experts
            return load_gpt_oss_mxfp4(snapshot, dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path) if local else source, dtype=dtype, trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path) if local else source, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ModelLoadError(f"{source}: could not load ({e})") from None
    check_architecture(model.config, source)
    return to_device(model, device), tokenizer


