"""The policy to train: a causal LM whose base is quantized (frozen) and whose LoRA adapters are trainable."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from ..data.calibration import check_source
from ..nn import LoraConfig
from ..quant import CALIBRATED, check_method
from .adapter import load_adapter
from .calibrate import calibration_ids, default_samples
from .convert import quantize_input_embeddings, quantize_model
from .load import load_causal_lm, plain_hf_directory
from .lora_attach import add_lora
from .sources import compute_dtype
from .precision import describe_keep_bf16
from .router import prepare_routers, router_modules
from .stream import stream_quantized
from .targets import quant_layers

if TYPE_CHECKING:
    from ..config import ModelSection


def build_policy(model_cfg: ModelSection, lora: LoraConfig, device: torch.device, *,
                 gradient_checkpointing: bool = False, train_rows: list[dict] | None = None, console=None,
                 train_router: bool = False, aux_loss: bool = False):
    """(model with a frozen quantized base + fresh or loaded LoRA, in eval mode, tokenizer).

    A 16-bit safetensors checkpoint (a local directory, the embedded model, a hub id's snapshot) is quantized
    while it loads, one decoder layer at a time, so the 16-bit model never has to fit in memory; other
    sources (GGUF, already quantized directories) load whole. `model_cfg.quant_method` chooses how
    (qerl.quant); the calibrated methods draw calibration text from `model_cfg.calibration` (train_rows: the
    run's problems, which the "auto" source adds to its mixture). With `gradient_checkpointing` each decoder
    layer is recomputed in the backward; console: where to report the quantization time and the 16-bit layers.
    Mixture-of-experts models (`moe:` config section): train_router makes the routers trainable fp32
    parameters (`qerl.models.router`; an adapter's trained routers are loaded either way); aux_loss=True (the
    run adds the load-balancing loss) only checks that the model has routers. Both raise ValueError on a model
    without routers.
    """
    method, cal = model_cfg.quant_method, model_cfg.calibration
    check_method(method, model_cfg.format)
    if method in CALIBRATED:
        check_source(cal.source)
    samples = default_samples(device) if cal.samples is None else cal.samples
    lora = LoraConfig(**dataclasses.asdict(lora))  # a copy of its own: every layer keeps a reference to it
    directory = plain_hf_directory(model_cfg.name)
    dtype = compute_dtype(model_cfg.dtype, device)
    trust = model_cfg.trust_remote_code
    t0 = time.perf_counter()
    if directory is not None:
        ids = None
        if method in CALIBRATED:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust)
            ids = calibration_ids(cal.source, tokenizer, samples, cal.max_tokens, train_rows=train_rows)
        model, tokenizer = stream_quantized(directory, model_cfg.format, lora, targets=lora.targets, dtype=dtype,
                                            device=device, embeddings=model_cfg.quantize_embeddings,
                                            trust_remote_code=trust, method=method, calibration=ids,
                                            keep_bf16=model_cfg.keep_bf16)
    else:
        model, tokenizer = load_causal_lm(model_cfg.name, dtype=dtype, device=device, trust_remote_code=trust)
        if quant_layers(model):  # an already quantized directory (its embedding is stored dense)
            if method != "rtn" or model_cfg.keep_bf16:
                raise ValueError(f"{model_cfg.name} is already quantized; model.quant_method and model.keep_bf16 "
                                 "apply only when qerl quantizes the model")
            add_lora(model, lora)
            if model_cfg.quantize_embeddings:
                quantize_input_embeddings(model, model.config.qerl_weight_format)
        else:
            ids = None
            if method in CALIBRATED:
                ids = calibration_ids(cal.source, tokenizer, samples, cal.max_tokens, model=model,
                                      train_rows=train_rows)
            quantize_model(model, model_cfg.format, lora, targets=lora.targets,
                           embeddings=model_cfg.quantize_embeddings, method=method, calibration=ids,
                           keep_bf16=model_cfg.keep_bf16)
    if console is not None and method != "rtn":
        console.print(f"quantized to {model_cfg.format} with {method} in {time.perf_counter() - t0:.1f} s")
    if console is not None and model_cfg.keep_bf16:
        kept = [n for n, m in quant_layers(model).items() if m.weight_format == "bf16"]
        console.print(describe_keep_bf16(model, kept, model_cfg.format))
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
