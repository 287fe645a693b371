"""One way to load a model for any command, in stages: the source, its 16-bit modules (or a quantized directory's
stored 4-bit state), quantized by method with LoRA attached as they are built, on the device, then a trained
adapter (`load_policy`). `qerl train` (through `models.policy`), `qerl eval`, `qerl quantize`, `qerl merge`, the
study and the benchmarks all describe what they want as a `ModelSpec`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..formats import FORMATS
from ..lora_config import DEFAULT_TARGETS, LoraConfig
from ..quant import CALIBRATED
from .quantization import Quantization


@dataclass(frozen=True)
class ModelSpec:
    """What to load and how to store its base.

    name: embedded name, HF directory, GGUF file, hub id or quantized directory (`load_causal_lm`), or random
      weights of a known shape, `random:qwen2.5-7b[,layers=N]` (`random_weights`; built layer by layer, no
      tokenizer).
    format: the base's weight format (nvfp4 | mxfp4 | nf4 | bf16); None keeps the model as stored (a 16-bit
      model stays plain, a quantized directory stays quantized). "bf16" is the quantized layer's 16-bit form:
      the same LoRA code path on unquantized weights.
    method / calibration_source / calibration_samples / calibration_max_tokens: how codes and scales are chosen
      (qerl.quant); the calibrated methods (gptq, awq) read calibration text (qerl.data.calibration);
      calibration_samples None: by device (`calibration.default_samples`).
    keep_bf16: module names / patterns / last:N left 16-bit; targets: the linears quantized; embeddings: also
      store the input embedding in `format`.
    lora: fresh LoRA adapters to attach (None: none); adapter: a PEFT adapter directory to load on top.
    dtype: of activations and unquantized tensors (auto: bf16 on a GPU, fp32 on the CPU); device: auto, cpu,
      cuda, cuda:N.
    """

    name: str
    format: str | None = None
    method: str = "rtn"
    calibration_source: str = "auto"
    calibration_samples: int | None = None
    calibration_max_tokens: int = 256
    keep_bf16: tuple[str, ...] = ()
    targets: tuple[str, ...] = tuple(DEFAULT_TARGETS)
    embeddings: bool = False
    lora: LoraConfig | None = None
    adapter: str | None = None
    dtype: str = "auto"
    device: str | torch.device = "auto"
    trust_remote_code: bool = False

    @property
    def torch_device(self) -> torch.device:
        if str(self.device) == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def check_spec(spec: ModelSpec) -> Quantization | None:
    """ValueError for a spec that cannot load, before anything is read: an unknown method or one the format
    does not take, an unknown calibration source, random weights of an unknown shape or without a format,
    keep_bf16 without a 4-bit format. Returns how the base is to be quantized (its LoRA and calibration tokens
    still to come; None: the model stays as stored)."""
    from ..data.calibration import check_source

    q = None
    if spec.format is not None:
        q = Quantization.of(spec.format, spec.method, targets=spec.targets, keep_bf16=spec.keep_bf16,
                            embeddings=spec.embeddings)
    if spec.method in CALIBRATED or (spec.lora is not None and spec.lora.init == "eora"):
        check_source(spec.calibration_source)
    if spec.name.startswith("random:"):
        from .random_weights import random_config

        random_config(spec.name)  # an unknown shape
        if spec.format is None:
            raise ValueError(f"{spec.name}: random weights need a weight format (bf16 for 16-bit LoRA)")
    if spec.keep_bf16 and spec.format in (None, "bf16"):
        raise ValueError("keep_bf16 keeps layers of a quantized base in bf16: it needs a quantized format "
                         "(nvfp4, mxfp4, nf4 or fp8)")
    return q


def load_policy(spec: ModelSpec, *, train_rows: list[dict] | None = None, show_progress: bool = False,
                before_quantize: Callable | None = None, console=None):
    """(model, tokenizer) as `spec` describes, in eval mode.

    The stages: the source (random weights, `random_weights`; an embedded name, HF directory, GGUF file, hub id
    or quantized directory, `pretrained`), the calibration tokens when the method reads them (`calibration`),
    the 16-bit modules of a layer source built one decoder layer at a time on the spec's device and quantized as
    the spec's `Quantization` with LoRA attached (`stream.build_from`), then a trained adapter (`adapter`). A
    quantized directory keeps its stored 4-bit state and gets fresh LoRA from `lora_attach`.

    A 16-bit safetensors checkpoint (a local directory, the embedded model, a hub id's snapshot) is read tensor by
    tensor, so the 16-bit model is never held whole; other sources (GGUF, mixtures of experts, a model looked at
    first) load whole and are handed to the builder, which takes their tensors over layer by layer.

    train_rows: the run's problems (the calibration sources "train" and "auto" read them).
    before_quantize(model, tokenizer): called on the whole 16-bit model before it is quantized (a reference for
    a fidelity check); it turns streaming off. console: where to say what took time (quantization with a
    calibrated method, the layers kept in bf16).
    """
    from .adapter import load_adapter
    from .calibration import calibration_ids, default_samples
    from .convert import quantize_input_embeddings
    from .pretrained import load_pretrained, plain_hf_directory
    from .lora_attach import add_lora
    from .precision import describe_keep_bf16
    from .random_weights import RandomLayers, is_random, random_calibration, random_config
    from .sources import compute_dtype
    from .stream import CheckpointLayers, LoadedLayers, build_from
    from .targets import quant_layers

    q = check_spec(spec)
    device = spec.torch_device
    dtype = compute_dtype(spec.dtype, device)
    trust = spec.trust_remote_code
    lora = LoraConfig(**dataclasses.asdict(spec.lora)) if spec.lora else None  # each layer keeps a reference
    if q is not None:
        q = dataclasses.replace(q, lora=lora)
    samples = default_samples(device) if spec.calibration_samples is None else spec.calibration_samples

    def calibrated(tokenizer, model=None) -> Quantization:
        """q with its calibration tokens, when its method or lora.init reads them."""
        if not q.calibrated:
            return q
        if tokenizer is None:
            what = f"--method {q.method}" if q.method in CALIBRATED else "lora.init eora"
            raise ValueError(f"{spec.name}: no tokenizer found; {what} needs one for calibration")
        return dataclasses.replace(q, calibration=calibration_ids(
            spec.calibration_source, tokenizer, samples, spec.calibration_max_tokens, model=model,
            train_rows=train_rows))

    t0 = time.perf_counter()
    layers = None  # a source read one decoder layer at a time: random weights, or a 16-bit safetensors directory
    if is_random(spec.name):
        layers = RandomLayers(random_config(spec.name), device, dtype=dtype)
        if q.calibrated:
            q = dataclasses.replace(q, calibration=random_calibration(layers.config, samples,
                                                                      spec.calibration_max_tokens))
    elif q is not None and before_quantize is None:
        directory = plain_hf_directory(spec.name)
        if directory is not None:
            layers = CheckpointLayers(directory, dtype=dtype, device=device, trust_remote_code=trust)
            if q.calibrated:
                q = calibrated(layers.tokenizer)
    if layers is None:  # loaded whole: 16-bit modules, or a directory's stored 4-bit state
        model, tokenizer = load_pretrained(spec.name, dtype, device, trust_remote_code=trust)
        if quant_layers(model):  # an already quantized directory (its embedding is stored dense)
            if spec.method != "rtn" or spec.keep_bf16:
                raise ValueError(f"{spec.name} is already quantized; the quantization method and the layers kept "
                                 "in bf16 were chosen when it was quantized (qerl quantize --method, --keep-bf16)")
            if lora is not None:
                if lora.init != "zero" and not spec.adapter:
                    raise ValueError(f"{spec.name} is already quantized: lora.init {lora.init} fits the adapter to "
                                     "the 16-bit weights, which it does not hold; load the 16-bit model instead")
                add_lora(model, lora)
            if spec.embeddings:
                quantize_input_embeddings(model, FORMATS[model.config.qerl_weight_format])
        elif q is not None:
            if before_quantize is not None:
                before_quantize(model, tokenizer)
            q = calibrated(tokenizer, model)
            layers = LoadedLayers(model, tokenizer)
            del model
    if layers is not None:
        model, tokenizer = build_from(layers, q, show_progress=show_progress)
    if console is not None and q is not None and q.method != "rtn":
        console.print(f"quantized to {q.format.name} with {q.method} in {time.perf_counter() - t0:.1f} s")
    if console is not None and spec.keep_bf16:
        kept = [n for n, m in quant_layers(model).items() if m.weight_format == "bf16"]
        console.print(describe_keep_bf16(model, kept, q.format))
    if spec.adapter:
        load_adapter(model, spec.adapter)
    return model.eval(), tokenizer
