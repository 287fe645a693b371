"""Calibrated quantization (gptq, awq) of a whole causal LM, one decoder layer after another.

Per layer, `qerl.models.calibrate` provides the statistics (each target's input Hessian, row samples) and the
group quantizer; this module runs the loop: AWQ folds its scales, the layer's targets are replaced
(`surgery.replace_linears`), and the quantized layer computes the next layer's inputs, so later layers absorb
earlier layers' error. `convert.quantize_model(method="gptq" | "awq")` and the streaming loader call it.
"""

from typing import Iterable

import torch
from rich.progress import Progress
from torch import nn

from ..nn import DEFAULT_TARGETS, LoraConfig
from ..quant import CALIBRATED, check_method
from ..quant.awq import FOLDED_SCALES, apply_awq, folded_covariances
from .calibrate import (awq_fake_quant, calibration_compute_dtype, capture_layer_inputs, computing_in, layer_output,
                        layer_statistics, method_quantizer, sibling_groups)
from .lora_attach import add_lora_to
from .precision import names_under
from .surgery import keep_dense_linears, replace_linears
from .targets import find_targets


@torch.no_grad()
def calibrated_quantize(model: nn.Module, fmt: str, method: str, ids: torch.Tensor, lora: LoraConfig | None = None,
                        targets: Iterable[str] = DEFAULT_TARGETS, device=None, fill=None,
                        show_progress: bool = False, keep: Iterable[str] = ()) -> dict:
    """Quantize every decoder layer of an HF causal LM with a calibrated method (gptq, awq), in order; also any
    method when `lora.init` is eora, whose adapters are fitted on each layer's input covariance (`lora_init`). The
    next layer's inputs then come from the quantized layer with its fitted adapter (the model RL starts from), so
    with gptq the later layers' Hessians, and so their codes, differ from gptq with a zero-init adapter. With awq
    the eora fit is to the folded weights, on the covariances of the folded inputs (`awq.folded_covariances`).

    ids: int64 [S, T] calibration tokens. Per layer (`qerl.models.calibrate`): its inputs' Hessians and row
    samples from the dense layer; AWQ folds its scales; the layer is quantized; the quantized layer makes
    the next layer's inputs, so later layers absorb earlier layers' error. fill(module, prefix): materialise
    each decoder layer from the meta device first (the streaming loader; the embedding and rotary module
    must be real already). keep: full names of targets left 16-bit (`keep_bf16`); AWQ still folds into them
    (exact), they are just not rounded. Returns {"tokens", "awq_scales": {module path: s fp32 [K]}}."""
    check_method(method, fmt)
    eora = lora is not None and lora.init == "eora"
    if method not in CALIBRATED and not eora:
        raise ValueError(f"{method!r} needs no calibration; use quantize_model(method={method!r})")
    targets = list(targets)
    device = torch.device(device or next(p.device for p in model.parameters() if not p.is_meta))
    compute = calibration_compute_dtype(device)
    body = model.model
    awq_scales = {}
    with Progress(disable=not show_progress, transient=True) as progress:
        batches = capture_layer_inputs(model, ids, device, compute)
        task = progress.add_task(f"calibrating + quantizing to {fmt} ({method})", total=len(body.layers))
        for i, layer in enumerate(body.layers):
            prefix = f"model.layers.{i}."
            if fill is not None:
                fill(layer, prefix)
            with computing_in(layer, compute):
                awq_scales.update(_calibrate_layer(layer, prefix, fmt, method, lora, targets, keep, batches, ids,
                                                   device))
                batches = [(layer_output(layer, h, kw), kw) for h, kw in batches]
            progress.advance(task)
    for name, p in model.named_parameters():  # embeddings, norms, lm_head: frozen as in the rtn path
        p.requires_grad_(".lora_" in name)
    if awq_scales:  # adapters of this model are saved / loaded as adapters of the unfolded model
        setattr(model, FOLDED_SCALES, awq_scales)
    return {"tokens": ids.numel(), "awq_scales": awq_scales}


def _calibrate_layer(layer: nn.Module, prefix: str, fmt: str, method: str, lora: LoraConfig | None, targets: list[str],
                     keep: Iterable[str], batches, ids: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """One decoder layer of `calibrated_quantize`: statistics, AWQ folding, quantization, in place.
    Returns this layer's AWQ scales {full module path: s fp32 [K]} (empty for gptq)."""
    kept_here = names_under(set(keep), prefix)
    names = [n for n in find_targets(layer, targets) if n not in kept_here]
    leaders = [g[0] for g in sibling_groups(names)]  # siblings share their input: one Hessian each
    # gptq: the Hessians; awq: row samples (it rounds without a Hessian: the folded weights see scaled inputs)
    eora = lora is not None and lora.init == "eora"
    hessians, samples = layer_statistics(layer, leaders, batches, ids.numel(), hessians=method == "gptq" or eora,
                                         samples=method == "awq")
    awq_scales = {}
    if method == "awq":
        leaf_samples = {n.rpartition(".")[2]: s.to(device) for n, s in samples.items()}
        folds = apply_awq(layer, leaf_samples, awq_fake_quant(fmt))
        awq_scales.update({prefix + name: s for name, s in folds.items()})
        if eora:  # the adapters are fitted to the folded weights, whose inputs are the folded ones
            hessians = folded_covariances(hessians, folds)
    kept = keep_dense_linears(layer, sorted(kept_here))
    if names:  # rtn (eora only): the default quantizer, as quantize_keeping's
        quantizer = None if method == "rtn" else method_quantizer(layer, fmt, method, targets, hessians)
        covariances = {n: hessians[g[0]] for g in sibling_groups(names) for n in g} if eora else None
        replace_linears(layer, fmt, lora, targets, quantizer, covariances=covariances)
    add_lora_to(kept, lora)
    return awq_scales
