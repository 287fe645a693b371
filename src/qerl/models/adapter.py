"""LoRA adapters as PEFT directories (`adapter_config.json` + `adapter_model.safetensors`).

Keys are PEFT's: `base_model.model.<module path>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r],
so `peft.PeftModel.from_pretrained(dense_base, dir)` reproduces qerl's outputs on the dequantized base.

Expert LoRA (`lora.experts`, on Qwen3-MoE / Qwen2-MoE `QuantExperts`) is saved as PEFT's LoRA on parameters
(peft >= 0.17 `target_parameters`, `ParamWrapper`): `target_parameters` ["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"], so `PeftModel.from_pretrained` on the dense HF model (experts holding the dequantized
base) gives qerl's logits. PEFT nests one wrapper per targeted parameter on the experts module, the first one
registered (gate_up_proj) innermost, and lays the E experts' factors out as one Linear pair each:

    <experts path>.base_layer.lora_A.weight  [E*r, H]   gate_up_proj: row e*r + j = qerl's lora_A[e, j, :]
    <experts path>.base_layer.lora_B.weight  [2I, r*E]  gate_up_proj: column j*E + e = qerl's lora_B[e, :, j]
    <experts path>.lora_A.weight             [E*r, I]   down_proj, the same way
    <experts path>.lora_B.weight             [H, r*E]

(`peft_expert_tensor` / `qerl_expert_tensor`; tests/test_expert_lora.py checks the layout against peft itself).

A mixture-of-experts model whose routers were made trainable (`qerl.models.router.prepare_routers`,
`moe.train_router`) also saves them, as PEFT's `modules_to_save` does: `modules_to_save` in the config
("mlp.gate", and "shared_expert_gate" for Qwen2-MoE) and each router's whole weight as
`base_model.model.<module path>.weight` fp32 [E, H] (or [1, H]; gpt-oss's router also `.bias` [E]).
Loading such an adapter prepares the routers (fp32, frozen unless they were already trainable) and copies
the weights in; loading one without routers into a model with prepared routers puts their original (base)
weights back.

A model quantized with AWQ in this process (`quantize_model(method="awq")`, `qerl train` with
`model.quant_method: awq`) carries its folded scales; by default its adapters are written for, and read
as adapters of, the original unfolded model, which is what `base_model_name_or_path` names
(`qerl.quant.awq.lora_between_bases`). Training checkpoints keep them as trained (`original_base=False`).
"""

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..nn import LoraConfig
from ..quant.awq import FOLDED_SCALES, lora_between_bases
from .atomic import atomic_directory
from .lora_attach import add_lora, lora_parameters
from .registry import upstream_name
from .router import (PEFT_MODULES_TO_SAVE, module_parameters, prepare_routers, reset_routers, router_modules,
                     router_parameters)
from .targets import quant_experts, quant_layers

PEFT_PREFIX = "base_model.model."
# expert LoRA: qerl's parameter name "<path>.lora_{A,B}.<weight>" <-> PEFT's "<path>.<nesting>lora_{A,B}.weight"
EXPERT_NESTING = {"gate_up_proj": "base_layer.", "down_proj": ""}


class AdapterError(ValueError):
    """An adapter that does not fit the model; the message names the file and what differs."""


def lora_config_of(model: nn.Module) -> LoraConfig:
    """Recover the LoraConfig of a model's attached adapters (rank, scaling, targets)."""
    layers = {n: m for n, m in quant_layers(model).items() if m.lora_A is not None}
    if not layers:
        raise ValueError("the model has no LoRA adapters attached")
    cfg = next(iter(layers.values())).lora_config
    targets = tuple(sorted({n.rsplit(".", 1)[-1] for n in layers}))
    experts = any(m.lora_A is not None for m in quant_experts(model).values())
    return dataclasses.replace(cfg, targets=targets, experts=experts)


def _expert_weight(name: str) -> str | None:
    """The experts weight ("gate_up_proj" / "down_proj") of an expert LoRA parameter name, else None."""
    path, _, weight = name.rpartition(".")
    return weight if weight in EXPERT_NESTING and path.endswith((".lora_A", ".lora_B")) else None


def peft_name(name: str) -> str:
    """qerl's LoRA parameter name -> PEFT's state-dict key (without PEFT_PREFIX)."""
    weight = _expert_weight(name)
    if weight is None:
        return name
    path, factor = name.rsplit(".", 2)[:2]
    return f"{path}.{EXPERT_NESTING[weight]}{factor}.weight"


def peft_expert_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """An expert LoRA factor in qerl's layout (A [E, r, K], B [E, N, r]) -> PEFT's (A [E*r, K], B [N, r*E])."""
    if name.rpartition(".")[0].endswith(".lora_A"):
        return t.reshape(-1, t.shape[-1])
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)


def qerl_expert_tensor(name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of `peft_expert_tensor`, shaped like the qerl parameter `like` ([E, r, K] or [E, N, r])."""
    if name.rpartition(".")[0].endswith(".lora_A"):
        return t.reshape(like.shape)
    e, n, r = like.shape
    return t.reshape(n, r, e).permute(2, 0, 1)


def _to_peft(lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{qerl name: tensor} -> {PEFT key without prefix: tensor in PEFT's layout}."""
    return {peft_name(k): peft_expert_tensor(k, v) if _expert_weight(k) else v for k, v in lora.items()}


def expert_target_parameters(model: nn.Module) -> list[str]:
    """PEFT `target_parameters` of the model's expert LoRA: "<module leaf>.<experts leaf>.<weight>" (e.g.
    "mlp.experts.gate_up_proj"), which PEFT matches as a suffix of each experts parameter's full name."""
    names = {".".join(n.split(".")[-2:]) for n, m in quant_experts(model).items() if m.lora_A is not None}
    return [f"{n}.{w}" for n in sorted(names) for w in EXPERT_NESTING]


def save_adapter(model: nn.Module, out, base_model_name_or_path: str | None = None, overwrite: bool = False,
                 original_base: bool = True, notes: dict[str, str] | None = None, check_owner: bool = True) -> Path:
    """Write the model's LoRA weights as a PEFT adapter directory (atomic; `atomic_directory`'s overwrite rule,
    check_owner=False for a run's own adapter/). original_base: for a model AWQ-folded in this process, write
    the adapter of the unfolded model (False: as trained). notes: {key: text} written into the safetensors
    metadata as `qerl_<key>` (e.g. a warning that the adapter was trained on rewards that all failed).
    base_model_name_or_path (default: the model's `_name_or_path`): the base as qerl names it; the PEFT config
    gets the name other tools resolve (an embedded name's hub id, `registry.upstream_name`) and the safetensors
    metadata keeps qerl's as `qerl_base_model` (`trained_base` reads it back)."""
    from peft import LoraConfig as PeftLoraConfig

    cfg = lora_config_of(model)
    bad = non_finite_parameters(model)
    if bad:  # nothing non-finite is ever saved: such an adapter would be accepted and silently score garbage
        raise ValueError(f"{out}: not written: {len(bad)} adapter tensors hold NaN or Inf (e.g. {bad[0]})")
    base = base_model_name_or_path or getattr(model.config, "_name_or_path", None)
    lora = {k: v.detach() for k, v in lora_parameters(model).items()}
    scales = getattr(model, FOLDED_SCALES, None)
    if original_base and scales:
        lora = lora_between_bases(lora, scales, to_original=True)
    routers = {k: v.detach() for k, v in router_parameters(model).items()}
    weights = {PEFT_PREFIX + k: v.float().contiguous().cpu() for k, v in {**_to_peft(lora), **routers}.items()}
    to_save = sorted({e for e in PEFT_MODULES_TO_SAVE for k in routers if k.rpartition(".")[0].endswith(e)})
    peft_cfg = PeftLoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, use_rslora=cfg.use_rslora,
        target_modules=list(cfg.targets), bias="none", task_type="CAUSAL_LM", modules_to_save=to_save or None,
        target_parameters=expert_target_parameters(model) or None,
        base_model_name_or_path=upstream_name(base) if base else None,
    )
    metadata = {"format": "pt", **{f"qerl_{k}": str(v) for k, v in (notes or {}).items()}}
    if base:
        metadata[BASE_KEY] = str(base)
    with atomic_directory(out, overwrite, kind="adapter", check_owner=check_owner) as tmp:
        peft_cfg.save_pretrained(str(tmp))
        save_file(weights, tmp / "adapter_model.safetensors", metadata=metadata)
    return Path(out).expanduser().resolve()


SOURCE_KEY = "qerl_source_model"  # config.json of a quantized directory: the model it was made from
BASE_KEY = "qerl_base_model"  # adapter_model.safetensors metadata: the base as qerl names it (an embedded name)


def trained_base(directory) -> str | None:
    """The base model of the adapter in `directory` as qerl loads it: the `qerl_base_model` its weights file
    records, else the PEFT config's `base_model_name_or_path` (adapters from other tools); None when neither
    names one. OSError / ValueError when the directory's files cannot be read."""
    from safetensors import safe_open

    directory = Path(directory).expanduser()
    weights = directory / "adapter_model.safetensors"
    if weights.is_file():
        with safe_open(str(weights), framework="pt") as f:
            base = (f.metadata() or {}).get(BASE_KEY)
        if base:
            return base
    return json.loads((directory / "adapter_config.json").read_text()).get("base_model_name_or_path")


def _same_model(a: str, b: str) -> bool:
    """Whether two model sources name the same model: equal names, or paths that resolve alike (an embedded
    name counts as its cache directory's name)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return pa.name.lower() == pb.name.lower()


def adapter_base_mismatch(directory, model_source: str) -> str | None:
    """A warning when the adapter in `directory` names another base model than `model_source` (a quantized
    directory counts as the model it was quantized from, `qerl_source_model` in its config.json); None when
    they agree or the adapter names none. The shapes may still fit (same architecture), so the load would
    succeed silently."""
    try:
        base = trained_base(directory)
    except Exception:  # a broken file of any kind (safetensors raises its own error): load_adapter reports it
        return None
    if not base:
        return None
    names = [str(model_source)]
    config = Path(model_source).expanduser() / "config.json"
    if config.is_file():
        try:
            names.append(json.loads(config.read_text()).get(SOURCE_KEY) or "")
        except ValueError:
            pass
    if any(n and _same_model(base, n) for n in names):
        return None
    return (f"{directory} was trained on {base!r}, not {model_source!r}: it loads because the shapes fit, but its "
            "scores there are not the trained policy's")


def read_adapter_weights(directory) -> dict[str, torch.Tensor]:
    """The tensors of `directory`/adapter_model.safetensors; AdapterError naming the file when it is missing,
    unreadable, or holds a NaN / Inf (a diverged run's adapter: loading it would score or merge garbage)."""
    weights_file = Path(directory) / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"{weights_file}: missing; an adapter directory needs adapter_config.json and "
                           "adapter_model.safetensors")
    try:
        weights = load_file(str(weights_file))
    except Exception as e:
        raise AdapterError(f"{weights_file}: corrupt or truncated safetensors file ({e})") from None
    bad = [k for k, w in weights.items() if w.is_floating_point() and not torch.isfinite(w).all()]
    if bad:
        raise AdapterError(f"{weights_file}: {len(bad)} of {len(weights)} tensors hold NaN or Inf (e.g. {bad[0]}): "
                           "the run that wrote it diverged; use an earlier checkpoint's adapter")
    return weights


def check_adapter_files(directory) -> None:
    """AdapterError when an adapter directory cannot be loaded as it stands (its config is not JSON, its
    weights are unreadable or non-finite): checked before a model load, to choose another checkpoint."""
    cfg_file = Path(directory) / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"{cfg_file}: missing; an adapter directory needs adapter_config.json and "
                           "adapter_model.safetensors")
    try:
        json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{cfg_file}: unreadable ({e})") from None
    read_adapter_weights(directory)


def non_finite_parameters(model: nn.Module) -> list[str]:
    """Names of the LoRA and router parameters holding a NaN or Inf (what an adapter saved now would hold)."""
    params = {**lora_parameters(model), **router_parameters(model)}
    return [n for n, p in params.items() if not torch.isfinite(p.detach()).all()]


def load_adapter(model: nn.Module, directory, original_base: bool = True) -> LoraConfig:
    """Attach (replacing any present) the PEFT adapter in `directory` to a quantized model. original_base:
    for a model AWQ-folded in this process, the adapter is one of the unfolded model (False: of this one)."""
    directory = Path(directory)
    cfg_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"{f}: missing; an adapter directory needs adapter_config.json and "
                               "adapter_model.safetensors")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_file}: invalid JSON ({e})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_file}: peft_type {raw.get('peft_type')!r} is not LORA")
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    experts = _adapter_experts(raw.get("target_parameters") or [], cfg_file)
    try:
        cfg = LoraConfig(r=int(raw["r"]), alpha=float(raw.get("lora_alpha", raw["r"])),
                         dropout=float(raw.get("lora_dropout", 0.0)), use_rslora=bool(raw.get("use_rslora", False)),
                         targets=tuple(t.rsplit(".", 1)[-1] for t in targets), experts=experts)
    except ValueError as e:
        raise AdapterError(f"{cfg_file}: {e}") from None
    weights = read_adapter_weights(directory)
    routers = _adapter_routers(model, raw.get("modules_to_save") or [], cfg_file)
    try:
        add_lora(model, cfg)
    except ValueError as e:  # e.g. expert LoRA for a model without 4-bit experts
        raise AdapterError(f"{cfg_file}: {e}") from None
    params = lora_parameters(model)
    expected = {PEFT_PREFIX + peft_name(k) for k in params} | {PEFT_PREFIX + k for k in routers}
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise AdapterError(
            f"{weights_file}: adapter does not fit this base model: "
            f"{len(missing)} weights missing (e.g. {sorted(missing)[:2]}), "
            f"{len(unexpected)} unexpected (e.g. {sorted(unexpected)[:2]})"
        )
    weights = {k[len(PEFT_PREFIX):]: w for k, w in weights.items()}
    peft_shapes = {peft_name(k): v.shape for k, v in _to_peft({k: p.detach() for k, p in params.items()}).items()}
    for name, shape in [*peft_shapes.items(), *((k, p.shape) for k, p in routers.items())]:
        if weights[name].shape != shape:
            raise AdapterError(f"{weights_file}: {name} has shape {tuple(weights[name].shape)}, the model needs "
                               f"{tuple(shape)} (an adapter for a different base model or rank)")
    lora = {name: (qerl_expert_tensor(name, weights[peft_name(name)], p) if _expert_weight(name)
                   else weights[name]) for name, p in params.items()}
    scales = getattr(model, FOLDED_SCALES, None)
    if original_base and scales:
        lora = lora_between_bases(lora, scales, to_original=False)
    if routers:  # fp32 masters, frozen unless already trainable
        routers = {k: v for k, v in prepare_routers(model, trainable=None).items() if k in routers}
    reset_routers(model, keep=routers)  # routers the adapter does not hold: the base's routing
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(lora[name])
        for name, p in routers.items():
            p.copy_(weights[name])
    return cfg


def _adapter_experts(target_parameters, cfg_file: Path) -> bool:
    """Whether the adapter config's PEFT `target_parameters` hold qerl's expert LoRA (exactly the experts'
    gate_up_proj and down_proj, `expert_target_parameters`); anything else is refused."""
    entries = [target_parameters] if isinstance(target_parameters, str) else list(target_parameters)
    if not entries:
        return False
    leaves = sorted({e.rpartition(".")[2] for e in entries})
    modules = {e.rpartition(".")[0] for e in entries}
    if leaves != sorted(EXPERT_NESTING) or not all(m.endswith("experts") for m in modules):
        raise AdapterError(f"{cfg_file}: target_parameters {entries} are not LoRA on MoE experts' gate_up_proj and "
                           "down_proj; qerl loads expert LoRA only in that form (lora.experts)")
    return True


def _adapter_routers(model: nn.Module, modules_to_save, cfg_file: Path) -> dict[str, torch.Tensor]:
    """{parameter name: current parameter} of the model's routers that the adapter's `modules_to_save` names; an
    entry naming anything else is refused (only MoE routers are saved besides LoRA)."""
    modules_to_save = [modules_to_save] if isinstance(modules_to_save, str) else list(modules_to_save)
    routers = router_modules(model)
    found = {}
    for entry in modules_to_save:
        hits = [n for n in routers if n.endswith(entry)]
        if not hits:
            raise AdapterError(f"{cfg_file}: modules_to_save entry {entry!r} names no mixture-of-experts router of "
                               f"this model; qerl loads LoRA weights and MoE routers only")
        for n in hits:
            found.update(module_parameters(n, routers[n]))
    return found
