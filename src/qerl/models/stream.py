"""The layer-by-layer builder: a quantized model built one decoder layer at a time from a layer source.

Layer sources: a Hugging Face safetensors directory (`CheckpointLayers`, read tensor by tensor), a model loaded
whole (`LoadedLayers`), random weights (`random_weights.RandomLayers`); `build_from` builds any of them.

`load_causal_lm` + `quantize_model` first hold the whole model in 16 bits: 145 GB for a 72B model, more than
an H200 (141 GB) and more than many hosts. Here the model skeleton lives on the meta device; each decoder
layer is materialised on the target device, filled from the memory-mapped safetensors files, quantized
(its dense weights dropped), and only then is the next one read. Peak memory: the quantized model plus one
16-bit decoder layer on the device, one tensor on the host. The result equals `load_causal_lm` followed by
`quantize_model` bit for bit (the fused q/k/v and gate/up groups that share a global scale live in one layer).
"""

from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from rich.progress import Progress
from torch import nn

from ..nn.quant_base import QuantizedModule
from ..quant import CALIBRATED
from .calibration import calibrated_quantize
from .convert import quantize_input_embeddings
from .experts import experts_to_quantize, replace_experts
from .lora_attach import add_expert_lora, add_lora_to
from .sources import MOE_ARCHITECTURES, ModelLoadError, check_architecture, check_safetensors
from .precision import names_under, resolve_checked_keep_bf16
from .quantization import Quantization
from .surgery import quantize_keeping


class _Checkpoint:
    """Every tensor of a directory's *.safetensors files by name, read one at a time (memory-mapped)."""

    def __init__(self, directory: Path, stack: ExitStack):
        from safetensors import safe_open

        self.where, self.used = {}, set()
        for f in check_safetensors(directory):
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
            for key in handle.keys():
                self.where[key] = handle

    def fill(self, module: nn.Module, prefix: str, device, dtype: torch.dtype) -> None:
        """Materialise `module` on `device` and copy every parameter / persistent buffer `prefix + name`
        from the checkpoint (cast to dtype where floating point). Missing tensors are an error."""
        persistent = set(module.state_dict().keys())
        transient = {n for n, _ in module.named_buffers() if n not in persistent}
        if transient:  # to_empty would leave them as garbage; none of the supported layers has any
            raise ModelLoadError(f"{prefix or 'model'}: computed buffers {sorted(transient)} cannot be streamed")
        module.to_empty(device=device)
        missing = []
        with torch.no_grad():
            for name, t in module.state_dict(keep_vars=True).items():
                key = prefix + name
                handle = self.where.get(key)
                if handle is None:
                    missing.append(key)
                    continue
                src = handle.get_tensor(key)
                if src.shape != t.shape:
                    raise ModelLoadError(f"{key}: checkpoint shape {tuple(src.shape)}, model {tuple(t.shape)}")
                t.copy_(src.to(dtype) if src.is_floating_point() else src)
                self.used.add(key)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")


def build_layer_by_layer(config, q: Quantization, fill, *, dtype: torch.dtype = torch.bfloat16, device=None,
                         show_progress: bool = False):
    """A causal LM for `config` quantized as `q`, built one decoder layer at a time: decoder linears
    QuantLinear(q.format) (+ `q.lora`), experts stacks, if any, frozen QuantExperts. `fill(module, prefix)`
    materialises a part of the meta-device skeleton on `device` and gives it its values (a layer source's: from a
    checkpoint, a model loaded whole, or random); each layer is quantized right after, so at most one 16-bit layer
    exists. Only LoRA parameters require grad.

    The calibrated methods (gptq, awq) and eora need `q.calibration`, which then flows through the layers as they
    are built (`calibration`). q.keep_bf16: as for `quantize_model`, resolved on the whole (meta) skeleton before
    any layer is read, so `last:N` and patterns spanning layers work."""
    from transformers import AutoModelForCausalLM

    fmt, method, lora = q.format, q.method, q.lora
    if q.eora and q.calibration is None:
        raise ValueError("lora.init eora needs calibration token ids")
    if method in CALIBRATED and q.calibration is None:
        raise ValueError(f"quantization method {method!r} needs calibration token ids")
    if q.eora and config.model_type in MOE_ARCHITECTURES:
        raise ValueError("lora.init eora does not handle mixture-of-experts models yet; use lora.init loftq")
    if method in CALIBRATED and config.model_type in MOE_ARCHITECTURES:
        raise ValueError(f"quantization method {method!r} does not handle mixture-of-experts layers yet; "
                         "use rtn or 4over6")
    expert_lora_fits = config.model_type in ("qwen2_moe", "qwen3_moe") and fmt.name != "bf16"
    if lora is not None and lora.experts and not expert_lora_fits:
        raise ValueError(f"lora.experts: expert LoRA needs a Qwen3-MoE / Qwen2-MoE model in a 4-bit format, not "
                         f"model_type {config.model_type!r} in {fmt.name}; turn lora.experts off")
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts_to_quantize(model, fmt, method, q.keep_bf16)  # its refusals, before any layer is read
    keep = resolve_checked_keep_bf16(model, q.keep_bf16, q.targets) if q.keep_bf16 else set()
    body = model.model
    fill(body.embed_tokens, "model.embed_tokens.")
    # rotary tables are computed in __init__ (non-persistent buffers): build that module on the device
    with torch.device(device):
        body.rotary_emb = type(body.rotary_emb)(config=config)
    if q.calibrated:
        calibrated_quantize(model, q, device=device, fill=fill, keep=keep, show_progress=show_progress)
    else:
        with Progress(disable=not show_progress, transient=True) as progress:
            task = progress.add_task(f"building + quantizing to {fmt.name}", total=len(body.layers))
            kept = {}
            for i, layer in enumerate(body.layers):
                prefix = f"model.layers.{i}."
                fill(layer, prefix)
                layer_kept = quantize_keeping(layer, q, names_under(keep, prefix))
                if fmt.name != "bf16":  # a mixture of experts: its 3-D expert stacks too (a no-op in dense layers)
                    replace_experts(layer, fmt, method, fit=lora)
                kept.update({prefix + n: m for n, m in layer_kept.items()})
                progress.advance(task)
            add_lora_to(kept, lora)  # after every quantized layer's, as quantize_model does
            if lora is not None and lora.experts:  # then the experts', as quantize_model does
                add_expert_lora(model, lora)
    fill(body.norm, "model.norm.")
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = body.embed_tokens.weight
    else:
        fill(model.lm_head, "lm_head.")
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    if q.embeddings:
        quantize_input_embeddings(model, fmt)
    model.config.qerl_weight_format = fmt.name
    return model


def _directory_tokenizer(directory: Path, trust_remote_code: bool):
    """A directory's tokenizer; None where it has none transformers can read."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None


class CheckpointLayers:
    """A directory of 16-bit safetensors as a layer source for `build_from`: its config, its tokenizer, and while
    `opened`, `fill(module, prefix)` from the memory-mapped files (cast to `dtype`, on `device`)."""

    def __init__(self, directory, *, dtype: torch.dtype = torch.bfloat16, device=None, trust_remote_code: bool = False):
        from transformers import AutoConfig

        self.directory = Path(directory)
        self.dtype, self.device = dtype, torch.device(device or "cpu")
        self.config = AutoConfig.from_pretrained(self.directory, trust_remote_code=trust_remote_code)
        self.tokenizer = _directory_tokenizer(self.directory, trust_remote_code)
        check_architecture(self.config, self.directory)

    @contextmanager
    def opened(self):
        """fill(module, prefix) while the files are open; once the model is built, every checkpoint tensor must have
        found a place in it."""
        with ExitStack() as stack:
            ckpt = _Checkpoint(self.directory, stack)
            yield lambda module, prefix: ckpt.fill(module, prefix, self.device, self.dtype)
            unused = sorted(set(ckpt.where) - ckpt.used - {"lm_head.weight"})
            unused = [k for k in unused if not k.endswith("rotary_emb.inv_freq")]  # computed, though some files hold it
            if unused:
                raise ModelLoadError(f"{self.directory}: {len(unused)} checkpoint tensor(s) the model has no place "
                                     f"for, e.g. {unused[:3]}")

    def finish(self, model):
        """(model, tokenizer) once built, with the directory's generation config (the EOS ids the engine stops on)."""
        from transformers import GenerationConfig

        if (self.directory / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(self.directory)
        return model, self.tokenizer


class LoadedLayers:
    """A causal LM loaded whole in 16 bits (`pretrained.load_causal_lm`: a GGUF file, a mixture of experts, a model
    looked at before it is quantized) as a layer source for `build_from`: `fill(module, prefix)` moves the loaded
    tensors under `prefix` into the skeleton's module and frees them in the loaded model, so the two hold about one
    copy together. A part the loaded model already stores quantized (gpt-oss's released MXFP4 experts) is moved
    over as it is."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device

    @contextmanager
    def opened(self):
        def fill(module: nn.Module, prefix: str) -> None:
            loaded = self.model.get_submodule(prefix.rstrip("."))
            stored = {n: m for n, m in loaded.named_modules() if n and isinstance(m, QuantizedModule)}
            stored = {n: m for n, m in stored.items() if not any(n.startswith(f"{o}.") for o in stored)}
            for name in stored:  # stored quantized: moved over as it is, not a 16-bit tensor to take
                module.set_submodule(name, nn.Module())
                loaded.set_submodule(name, nn.Module())
            transient = {n for n, _ in module.named_buffers() if n not in module.state_dict()}
            if transient:  # computed in __init__, not in a state dict; none of the supported layers has any
                raise ModelLoadError(f"{prefix or 'model'}: computed buffers {sorted(transient)} cannot be moved")
            module.load_state_dict(loaded.state_dict(), assign=True)  # the loaded tensors themselves, no copy
            for name, part in stored.items():
                module.set_submodule(name, part)
            loaded.to_empty(device="meta")  # the loaded model lets go of them

        yield fill

    def finish(self, model):
        """(model, tokenizer) once built, with the loaded model's generation config."""
        model.generation_config = self.model.generation_config
        return model, self.tokenizer


def build_from(layers, q: Quantization, *, show_progress: bool = False):
    """(model in eval mode, tokenizer): the decoder layers of a layer source (`CheckpointLayers`,
    `random_weights.RandomLayers`: its config, dtype, device, `opened()` giving `fill`, `finish(model)`) built one at
    a time and quantized as `q` (`build_layer_by_layer`)."""
    with layers.opened() as fill:
        model = build_layer_by_layer(layers.config, q, fill, dtype=layers.dtype, device=layers.device,
                                     show_progress=show_progress)
    model, tokenizer = layers.finish(model)
    return model.eval(), tokenizer


def stream_quantized(directory, q: Quantization, *, dtype: torch.dtype = torch.bfloat16, device=None,
                     trust_remote_code: bool = False, show_progress: bool = False):
    """(model, tokenizer) from a Hugging Face directory of safetensors, quantized as `q` while loading.

    Same result as `load_causal_lm(directory)` then `quantize_model(model, q.format, q.lora, q.targets,
    embeddings=..., keep_bf16=...)`, without ever holding the 16-bit model.
    """
    layers = CheckpointLayers(directory, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    return build_from(layers, q, show_progress=show_progress)
