"""Quantized checkpoints: a Hugging Face directory other tools load.

NVFP4 / MXFP4 are written as compressed-tensors `nvfp4-pack-quantized` / `mxfp4-pack-quantized` (what
vLLM and llm-compressor read): `<module>.weight_packed`, `.weight_scale`, `.weight_global_scale` (NVFP4
only) and a `quantization_config` in config.json. NF4 is written in the bitsandbytes serialization that
transformers reads (`<module>.weight` packed + `.weight.absmax`, `.weight.quant_map`,
`.weight.quant_state.bitsandbytes__nf4`). LoRA weights never go in here: they are saved as a PEFT adapter.

A quantized input embedding (`QuantEmbedding`, opt-in) is written as the dense table it looks up,
`<module>.weight` in its lookup dtype (bf16 for a bf16 model), and is not a quantization target: the
directory stays a standard checkpoint. Quantizing that table again on load (`quantize_input_embeddings`)
gives back the same codes and scales when the original table was bf16 (see tests/test_quant_embedding.py).

Linears kept in 16 bits (`keep_bf16`: QuantLinear format "bf16") are written as plain `<module>.weight`
(bf16) + bias and listed in `ignore` / `llm_int8_skip_modules` beside lm_head, so transformers and vLLM load
them as ordinary dense linears; config.json's `qerl_keep_bf16` names them so that `load_quantized` makes
them QuantLinear("bf16") again (other ignored linears, e.g. non-targets, stay nn.Linear).

4-bit MoE experts (`QuantExperts`, Qwen3-MoE / Qwen2-MoE) are written per expert and projection,
`<experts>.{e}.gate_proj.weight_packed` etc., each a slice of the stacked buffers (`qerl.models.moe_checkpoint`),
and stacked again on load, bit for bit. The routers (`mlp.gate`, `mlp.shared_expert_gate`) stay 16-bit and are
listed in `ignore`, as llm-compressor does, so that loaders do not look for quantized router tensors.
"""

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..formats import get_format
from ..nn import QuantEmbedding, QuantLinear
from ..quant.awq import channel_scales, set_channel_scales
from .atomic import atomic_directory
from .moe_checkpoint import check_saveable_experts, expert_tensors, has_expert_tensors, take_experts
from .router import router_modules
from .sources import ModelLoadError, check_architecture, check_safetensors
from .precision import partial_sibling_groups
from .targets import quant_experts, quant_layers

MAX_SHARD_BYTES = 5 * 1024**3
CT_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "fp8": "float-quantized"}
_CT_WEIGHTS = {
    "nvfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
              "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
    "mxfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
              "dynamic": False, "scale_dtype": "torch.uint8"},
    "fp8": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel",
            "dynamic": False},
}
# fp8: activations quantized per token at run time (W8A8 where FP8 tensor cores run it; qerl.kernels.fp8_matmul)
_CT_INPUTS = {"fp8": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "token",
                      "dynamic": True}}
_BNB_STATE = "quant_state.bitsandbytes__nf4"
KEEP_KEY = "qerl_keep_bf16"  # config.json: the linears qerl kept in bf16 (all also in the ignore list)


def quantization_config(fmt: str, ignore: list[str]) -> dict:
    """config.json's `quantization_config` for a weight-only checkpoint (compressed-tensors or bitsandbytes)."""
    if fmt in CT_FORMATS:
        group = {"targets": ["Linear"], "weights": dict(_CT_WEIGHTS[fmt]), "input_activations": _CT_INPUTS.get(fmt),
                 "output_activations": None, "format": CT_FORMATS[fmt]}
        return {"config_groups": {"group_0": group}, "quant_method": "compressed-tensors", "kv_cache_scheme": None,
                "format": CT_FORMATS[fmt], "quantization_status": "compressed", "global_compression_ratio": None,
                "ignore": ignore}
    if fmt == "nf4":
        return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
                "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
                "llm_int8_skip_modules": ignore}
    raise ValueError(f"format {fmt!r} has no quantized checkpoint layout (save a bf16 model with save_pretrained)")


def _nf4_to_bnb(name: str, layer: QuantLinear) -> dict[str, torch.Tensor]:
    from ..formats.nf4 import NF4_CODE

    meta = {"quant_type": "nf4", "blocksize": get_format("nf4").block, "dtype": "bfloat16",
            "shape": [layer.out_features, layer.in_features]}
    return {
        f"{name}.weight": layer.weight_packed.reshape(-1, 1),
        f"{name}.weight.absmax": layer.weight_absmax,
        f"{name}.weight.quant_map": torch.tensor(NF4_CODE, dtype=torch.float32),
        f"{name}.weight.{_BNB_STATE}": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8),
    }


def split_kept(model: nn.Module) -> tuple[dict[str, QuantLinear], dict[str, QuantLinear]]:
    """(4-bit layers, layers kept in bf16) of a model with one 4-bit format plus optional `keep_bf16`
    layers. An all-bf16 model (format bf16) has no kept layers: its bf16 layers are its base."""
    layers = quant_layers(model)
    fmts = {m.weight_format for m in layers.values()}
    if len(fmts - {"bf16"}) > 1 or not fmts:
        raise ValueError(f"expected one quantized weight format in the model (plus layers kept in bf16), "
                         f"found {sorted(fmts) or 'none'}")
    if fmts == {"bf16"}:
        return layers, {}
    kept = {n: m for n, m in layers.items() if m.weight_format == "bf16"}
    return {n: m for n, m in layers.items() if n not in kept}, kept


def check_experts_format(model: nn.Module, fmt: str) -> dict:
    """The model's 4-bit experts {name: QuantExperts}; ValueError when one cannot be saved (a layout without a
    per-expert form, or a format other than the linears' `fmt`)."""
    experts = quant_experts(model)
    check_saveable_experts(experts)
    other = sorted({m.weight_format for m in experts.values()} - {fmt})
    if other:
        raise ValueError(f"the MoE experts are stored in {other[0]}, the linears in {fmt}: a checkpoint holds one "
                         "4-bit format")
    return experts


def checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything but LoRA, with quantized layers in their on-disk names; a tied lm_head is left out.
    A kept bf16 layer's state is already `<module>.weight` [N, K] bf16 (+ bias): written as it is. 4-bit
    experts are written per expert (`moe_checkpoint.expert_tensors`)."""
    layers, _ = split_kept(model)
    fmts = {m.weight_format for m in layers.values()}
    experts = check_experts_format(model, next(iter(fmts - {"bf16"}), "bf16"))
    state = {k: v for k, v in model.state_dict().items() if ".lora_A." not in k and ".lora_B." not in k}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    for name, emb in model.named_modules():
        if isinstance(emb, QuantEmbedding):  # dense on disk: not a compressed-tensors / bnb target
            for t in emb.quantized_tensors():
                state.pop(f"{name}.{t}")
            state[f"{name}.weight"] = emb.dequantized_weight()
    if fmts == {"nf4"}:
        for name, layer in layers.items():
            state.pop(f"{name}.weight_packed")
            state.pop(f"{name}.weight_absmax")
            state.update(_nf4_to_bnb(name, layer))
    for name, quant in experts.items():
        for buffer in quant._tensor_names:
            state.pop(f"{name}.{buffer}")
        state.update(expert_tensors(name, quant))
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def write_shards(state: dict[str, torch.Tensor], directory: Path) -> None:
    shards, current, size = [], {}, 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# AWQ's per-channel scales of folded norms (`qerl.quant.awq`), which AQN divides its noise by. In a
# subdirectory: loaders that read every top-level *.safetensors as weights never see it.
CHANNEL_SCALES_FILE = "qerl/awq_channel_scales.safetensors"


def save_quantized(model: nn.Module, tokenizer, out, overwrite: bool = False) -> Path:
    """Write the quantized base (no LoRA) as an HF directory; atomic: `out` appears complete or not at all.
    A model quantized with awq also gets CHANNEL_SCALES_FILE ({norm path: fp32 [D]}). 4-bit MoE experts are
    written per expert (module docstring); experts of another layout (ValueError) are refused before anything
    is written."""
    layers, kept = split_kept(model)
    fmt = next(iter(layers.values())).weight_format
    check_experts_format(model, fmt)
    state = checkpoint_state_dict(model)
    quant = layers.keys() | kept.keys()
    # dense linears, not counting a QuantLinear's own LoRA A / B (never written here)
    dense = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and n not in quant and n.rpartition(".")[0] not in quant]
    # MoE routers stay 16-bit; Qwen3-MoE's is not an nn.Linear in transformers 5, but serving engines build it
    # as a linear, so it is named here (a Qwen2-MoE shared_expert_gate is already among the dense linears)
    ignore = sorted({*dense, *kept, *router_modules(model)})
    _warn_partial_groups(kept, [*layers, *kept])
    config = model.config.to_dict()
    config.pop("qerl_weight_format", None)
    config.pop(KEEP_KEY, None)
    if kept:
        config[KEEP_KEY] = sorted(kept)
    config["quantization_config"] = quantization_config(fmt, ignore)
    with atomic_directory(out, overwrite, kind="quantized model") as tmp:
        write_model_files(tmp, state, config, model, tokenizer)
        scales = channel_scales(model)
        if scales:
            (tmp / CHANNEL_SCALES_FILE).parent.mkdir()
            save_file(scales, tmp / CHANNEL_SCALES_FILE)
    return Path(out).expanduser().resolve()


def _warn_partial_groups(kept, names) -> None:
    partial = partial_sibling_groups(kept, names)
    if partial:
        warnings.warn(f"keep_bf16 splits {len(partial)} fused sibling group(s), e.g. {partial[0]}: qerl and "
                      "transformers load this directory, vLLM refuses it (it fuses q/k/v and gate/up and needs "
                      "one scheme per group); keep whole groups for vLLM", stacklevel=3)


def _format_of(qcfg: dict, path: Path) -> str:
    method = qcfg.get("quant_method")
    if method == "bitsandbytes":
        nf4 = qcfg.get("load_in_4bit") and qcfg.get("bnb_4bit_quant_type") == "nf4"
        if not nf4 or qcfg.get("bnb_4bit_use_double_quant"):
            raise ModelLoadError(f"{path}: only single-quantized bitsandbytes NF4 4-bit checkpoints are supported")
        return "nf4"
    if method != "compressed-tensors":
        raise ModelLoadError(f"{path}: quantization method {method!r} is not supported "
                             "(compressed-tensors or bitsandbytes nf4)")
    groups = qcfg.get("config_groups") or {}
    formats = {g.get("format") or qcfg.get("format") for g in groups.values()} or {qcfg.get("format")}
    by_ct = {v: k for k, v in CT_FORMATS.items()}
    if len(formats) != 1 or next(iter(formats)) not in by_ct:
        raise ModelLoadError(f"{path}: compressed-tensors format {sorted(map(str, formats))} is not supported "
                             f"(supported: {sorted(by_ct)})")
    if qcfg.get("quantization_status", "compressed") != "compressed":
        raise ModelLoadError(f"{path}: quantization_status {qcfg.get('quantization_status')!r}; expected 'compressed'")
    return by_ct[next(iter(formats))]


def _take_layer_tensors(state: dict, name: str, fmt: str) -> dict[str, torch.Tensor] | None:
    """Pop a quantized layer's tensors out of a checkpoint state dict (None if `name` is not quantized)."""
    if fmt == "nf4":
        if f"{name}.weight.{_BNB_STATE}" not in state:
            return None
        packed = state.pop(f"{name}.weight")
        absmax = state.pop(f"{name}.weight.absmax")
        meta = json.loads(bytes(state.pop(f"{name}.weight.{_BNB_STATE}").tolist()))
        state.pop(f"{name}.weight.quant_map", None)
        n, k = meta["shape"]
        return {"weight_packed": packed.reshape(n, k // 2), "weight_absmax": absmax.float()}
    # a tensor only the quantized form has (a layer kept 16-bit has `weight` alone): weight_packed, fp8's weight_scale
    marker = next(t for t in get_format(fmt).tensor_names if t != "weight")
    if f"{name}.{marker}" not in state:
        return None
    tensors = {t: state.pop(f"{name}.{t}") for t in get_format(fmt).tensor_names if f"{name}.{t}" in state}
    missing = set(get_format(fmt).tensor_names) - set(tensors)
    if missing:
        raise ModelLoadError(f"{name}: checkpoint lacks {sorted(missing)} for format {fmt}")
    state.pop(f"{name}.input_global_scale", None)  # W4A4 checkpoints: activations stay 16-bit here
    return tensors


def _kept_layer(state: dict, name: str, mod: nn.Linear, dtype: torch.dtype, path: Path) -> QuantLinear:
    """Pop a kept linear's dense `<name>.weight` [N, K] (+ bias) into a QuantLinear("bf16")."""
    weight = state.pop(f"{name}.weight", None)
    if weight is None or tuple(weight.shape) != (mod.out_features, mod.in_features):
        found = "nothing" if weight is None else f"shape {tuple(weight.shape)}"
        raise ModelLoadError(f"{path}: {KEEP_KEY} lists {name}, but its dense weight is {found}")
    bias = state.pop(f"{name}.bias", None)
    return QuantLinear(mod.in_features, mod.out_features, "bf16", {"weight": weight.to(torch.bfloat16)},
                       None if bias is None else bias.to(dtype))


def load_quantized(path, dtype: torch.dtype = torch.bfloat16, device=None):
    """A quantized HF directory -> (model with QuantLinear layers and, for MoE, QuantExperts; no LoRA yet,
    tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .experts import is_experts_module

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    check_architecture(config, path)
    qcfg = config.quantization_config
    qcfg = qcfg if isinstance(qcfg, dict) else qcfg.to_dict()
    fmt = _format_of(qcfg, path)
    del config.quantization_config
    keep = set(getattr(config, KEEP_KEY, None) or ())
    if hasattr(config, KEEP_KEY):
        delattr(config, KEEP_KEY)
    device = torch.device(device or "cpu")
    state = {}
    for f in check_safetensors(path):
        state.update(load_file(str(f), device=str(device)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, mod in list(model.named_modules()):
        if is_experts_module(mod) and has_expert_tensors(state, name, fmt):
            model.set_submodule(name, take_experts(state, name, mod, fmt, path))
            continue
        if not isinstance(mod, nn.Linear):
            continue
        if name in keep:
            model.set_submodule(name, _kept_layer(state, name, mod, dtype, path))
            keep.discard(name)
            continue
        tensors = _take_layer_tensors(state, name, fmt)
        if tensors is None:
            continue
        bias = state.pop(f"{name}.bias", None)
        layer = QuantLinear(mod.in_features, mod.out_features, fmt, tensors,
                            None if bias is None else bias.to(dtype))
        model.set_submodule(name, layer)
    if keep:
        raise ModelLoadError(f"{path}: {KEEP_KEY} lists {sorted(keep)[:3]}, which are not linears of the model")
    if not any(isinstance(m, QuantLinear) and m.weight_format != "bf16" for m in model.modules()):
        raise ModelLoadError(f"{path}: config says {fmt} but no quantized layer was found in the weights")
    assign_remaining(model, state, path, device, dtype)
    if (path / CHANNEL_SCALES_FILE).is_file():
        try:
            set_channel_scales(model, load_file(str(path / CHANNEL_SCALES_FILE), device=str(device)))
        except (ValueError, OSError) as e:
            raise ModelLoadError(f"{path / CHANNEL_SCALES_FILE}: {e}") from None
    model.config.qerl_weight_format = fmt
    return model.eval(), directory_tokenizer(path)


def write_model_files(directory: Path, state: dict[str, torch.Tensor], config: dict, model: nn.Module,
                      tokenizer) -> None:
    """A model directory's files: the safetensors shards of `state`, config.json from the `config` dict, the
    model's generation config and the tokenizer (when there is one)."""
    write_shards(state, directory)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def assign_remaining(model: nn.Module, state: dict[str, torch.Tensor], path: Path, device, dtype) -> None:
    """Finish a model built on the meta device whose quantized modules are already in place: assign the
    remaining checkpoint tensors (floating ones cast to `dtype`), tie the embeddings where the config says so,
    rebuild the rotary tables, and freeze every parameter. ModelLoadError (naming `path`) for a tensor the
    model has no place for, or a parameter / buffer the checkpoint did not provide."""
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise ModelLoadError(f"{path}: unexpected tensors {result.unexpected_keys[:5]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    materialize_rotary(model, device)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ModelLoadError(f"{path}: checkpoint lacks tensors {still_meta[:5]}")
    for p in model.parameters():
        p.requires_grad_(False)


def directory_tokenizer(path: Path):
    """The tokenizer saved in a model directory, or None when it holds none."""
    from transformers import AutoTokenizer

    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return AutoTokenizer.from_pretrained(path) if has_tokenizer else None


def materialize_rotary(model: nn.Module, device: torch.device) -> None:
    """Rotary embeddings keep non-persistent buffers (inv_freq) that no checkpoint holds: rebuild them."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)) and "rotary" in type(mod).__name__.lower():
            with torch.device(device):
                fresh = type(mod)(config=model.config)
            model.set_submodule(name, fresh)
