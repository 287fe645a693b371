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
from ..quant.awq import FOLDED_SCALES, apply_awq
from . import lora_init
from .calibrate import (awq_fake_quant, calibration_compute_dtype, capture_layer_inputs, computing_in,
                        drift_covariances, layer_output, layer_statistics, method_quantizer, reference_inputs,
                        sibling_groups)
from .lora_attach import add_lora_to
from .lora_init import EoraStatistics
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
    with gptq the later layers' Hessians, and so their codes, differ from gptq with a zero-init adapter. With
    `lora_init.EORA_DRIFT` (an experiment, off) eora fits each target's output against the 16-bit model's
    instead: a second stream of hidden states, the 16-bit model's, runs beside the quantized one (the dense
    layer is at hand before it is quantized), doubling the hidden states kept (`_eora_drift_layer`).

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
    if eora and method == "awq":
        raise ValueError("lora.init eora: not with awq (its folded scales change each layer's inputs); use rtn, "
                         "4over6 or gptq, or lora.init loftq")
    targets = list(targets)
    device = torch.device(device or next(p.device for p in model.parameters() if not p.is_meta))
    compute = calibration_compute_dtype(device)
    body = model.model
    awq_scales = {}
    with Progress(disable=not show_progress, transient=True) as progress:
        batches = capture_layer_inputs(model, ids, device, compute)
        # eora's drift fit: the 16-bit model's hidden states, equal to the quantized model's before layer 0
        reference = [h for h, _ in batches] if eora and lora_init.EORA_DRIFT else None
        task = progress.add_task(f"calibrating + quantizing to {fmt} ({method})", total=len(body.layers))
        for i, layer in enumerate(body.layers):
            prefix = f"model.layers.{i}."
            if fill is not None:
                fill(layer, prefix)
            with computing_in(layer, compute):
                scales, reference = _calibrate_layer(layer, prefix, fmt, method, lora, targets, keep, batches,
                                                     reference, ids, device)
                awq_scales.update(scales)
                batches = [(layer_output(layer, h, kw), kw) for h, kw in batches]
            progress.advance(task)
    for name, p in model.named_parameters():  # embeddings, norms, lm_head: frozen as in the rtn path
        p.requires_grad_(".lora_" in name)
    if awq_scales:  # adapters of this model are saved / loaded as adapters of the unfolded model
        setattr(model, FOLDED_SCALES, awq_scales)
    return {"tokens": ids.numel(), "awq_scales": awq_scales}


def _calibrate_layer(layer: nn.Module, prefix: str, fmt: str, method: str, lora: LoraConfig | None, targets: list[str],
                     keep: Iterable[str], batches, reference: list[torch.Tensor] | None, ids: torch.Tensor, device
                     ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor] | None]:
    """One decoder layer of `calibrated_quantize`: statistics, AWQ folding, quantization, in place.
    reference: eora's 16-bit hidden states [B, T, D] per batch (None otherwise). Returns (this layer's AWQ
    scales {full module path: s fp32 [K]} (empty for gptq), the 16-bit stream after this layer or None)."""
    kept_here = names_under(set(keep), prefix)
    names = [n for n in find_targets(layer, targets) if n not in kept_here]
    eora = lora is not None and lora.init == "eora"
    if eora and reference is not None:
        return {}, _eora_drift_layer(layer, fmt, method, lora, kept_here, names, batches, reference, ids)
    leaders = [g[0] for g in sibling_groups(names)]  # siblings share their input: one Hessian each
    # gptq: the Hessians; awq: row samples (it rounds without a Hessian: the folded weights see scaled inputs);
    # eora: the Hessians are its input covariances
    hessians, samples = layer_statistics(layer, leaders, batches, ids.numel(), hessians=method == "gptq" or eora,
                                         samples=method == "awq")
    awq_scales = {}
    if method == "awq":
        leaf_samples = {n.rpartition(".")[2]: s.to(device) for n, s in samples.items()}
        for name, s in apply_awq(layer, leaf_samples, awq_fake_quant(fmt)).items():
            awq_scales[prefix + name] = s
    kept = keep_dense_linears(layer, sorted(kept_here))
    if names:  # rtn (eora only): the default quantizer, as quantize_keeping's
        quantizer = None if method == "rtn" else method_quantizer(layer, fmt, method, targets, hessians)
        covariances = {n: hessians[g[0]] for g in sibling_groups(names) for n in g} if eora else None
        replace_linears(layer, fmt, lora, targets, quantizer, covariances=covariances)
    add_lora_to(kept, lora)
    return awq_scales, None


def _eora_drift_layer(layer: nn.Module, fmt: str, method: str, lora: LoraConfig, kept_here: set[str],
                      names: list[str], batches, reference: list[torch.Tensor], ids: torch.Tensor
                      ) -> list[torch.Tensor]:
    """One decoder layer with eora's drift fit (`lora_init.EORA_DRIFT`; rtn, 4over6 or gptq): returns the 16-bit
    stream after it.

    The 16-bit layer runs once on the 16-bit stream (each target's X_fp, and the next layer's 16-bit inputs).
    Then the sibling groups (q/k/v, o, gate/up, down) are quantized one after another in the order the forward
    reaches them, each fitted on its X_q from the layer as quantized so far: o_proj's inputs come from the
    quantized, adapted q/k/v, as they will in the model. (Taking every X_q from the dense layer instead makes
    o_proj and down_proj fit the input drift that q/k/v and gate/up's adapters already remove: on SmolLM2 NVFP4
    that double correction took the KL from 0.21 with zero init to 1.07.) gptq's Hessians still come from the
    dense layer, as without eora, so the first layer's codes are plain gptq's."""
    groups = sibling_groups(names)
    leaders = [g[0] for g in groups]
    hessians = {}
    if method == "gptq":
        hessians, _ = layer_statistics(layer, leaders, batches, ids.numel(), hessians=True, samples=False)
    order, fp_inputs, reference = reference_inputs(layer, leaders, batches, reference)
    kept = keep_dense_linears(layer, sorted(kept_here))  # before the fits: the quantized model's X_q go through them
    group_of = {g[0]: g for g in groups}
    for leader in order:
        group = group_of[leader]
        qq, fq = drift_covariances(layer, leader, batches, fp_inputs.pop(leader))
        leaves = [n.rpartition(".")[2] for n in group]  # this group only: the later ones stay dense for now
        quantizer = None if method == "rtn" else method_quantizer(layer, fmt, method, leaves, hessians)
        replace_linears(layer, fmt, lora, leaves, quantizer,
                        covariances={n: EoraStatistics(qq, fq) for n in group})  # siblings share their input
    add_lora_to(kept, lora)
    return reference
