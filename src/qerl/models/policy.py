"""The policy to train: a causal LM whose base is quantized (frozen) and whose LoRA adapters are trainable."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..nn import LoraConfig
from .adapter import load_adapter
from .loader import ModelSpec, load_policy
from .router import prepare_routers, router_modules

if TYPE_CHECKING:
    from ..config import ModelSection


def policy_spec(model_cfg: ModelSection, lora: LoraConfig, device: torch.device) -> ModelSpec:
    """The config's `model:` and `lora:` sections as the loader's ModelSpec."""
    cal = model_cfg.calibration
    return ModelSpec(name=model_cfg.name, format=model_cfg.format, method=model_cfg.quant_method,
                     calibration_source=cal.source, calibration_samples=cal.samples,
                     calibration_max_tokens=cal.max_tokens, keep_bf16=tuple(model_cfg.keep_bf16),
                     targets=tuple(lora.targets), embeddings=model_cfg.quantize_embeddings, lora=lora,
                     dtype=model_cfg.dtype, device=device, trust_remote_code=model_cfg.trust_remote_code)


def build_policy(model_cfg: ModelSection, lora: LoraConfig, device: torch.device, *,
                 gradient_checkpointing: bool | str = False, train_rows: list[dict] | None = None, console=None,
                 train_router: bool = False, aux_loss: bool = False):
    """(model with a frozen quantized base + fresh or loaded LoRA, in eval mode, tokenizer): `load_policy`,
    then what training adds.

    train_rows: the run's problems (calibration sources "train" and "auto"). With `gradient_checkpointing` true or
    "auto" the decoder layers are made checkpointable (which of them recompute: `qerl.rl.recompute`); console: where
    to report the quantization time and the 16-bit layers. Mixture-of-experts models (`moe:` config section):
    train_router makes the routers trainable fp32 parameters (`qerl.models.router`; an adapter's trained routers
    are loaded either way); aux_loss=True (the run adds the load-balancing loss) only checks that the model has
    routers. Both raise ValueError on a model without routers.
    """
    spec = policy_spec(model_cfg, lora, device)
    model, tokenizer = load_policy(dataclasses.replace(spec, adapter=None), train_rows=train_rows, console=console)
    if (train_router or aux_loss) and not router_modules(model):
        keys = " and ".join(k for k, on in (("moe.train_router", train_router), ("moe.aux_loss_coef > 0", aux_loss))
                            if on)
        raise ValueError(f"{keys}: {model_cfg.name} ({type(model).__name__}) is not a mixture-of-experts model (no "
                         "router found); these keys apply to MoE models (Qwen3-MoE, Qwen2-MoE) only")
    if train_router:
        prepare_routers(model, trainable=True)
    if model_cfg.adapter:
        load_adapter(model, model_cfg.adapter)  # keeps the routers trainable; loads trained ones if it holds them
    if tokenizer is None:
        raise ValueError(f"{model_cfg.name}: no tokenizer found; training needs one")
    model.config.use_cache = False  # training forwards never reuse a KV cache (the rollout engine has its own)
    # MoE: transformers' own router logits and aux loss stay off; qerl's loss pass hooks the routers itself when
    # moe.aux_loss_coef > 0 (qerl.rl.router_aux), on the real tokens of its packed or padded forward
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = False
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.eval(), tokenizer


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward (non-reentrant: works with frozen inputs)."""
    # newer transformers renamed it; 5.17 (our GPU image) only has the old name
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
