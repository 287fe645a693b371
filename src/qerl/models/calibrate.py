"""Calibrated quantization, one decoder layer at a time (GPTQ / AWQ need the inputs each layer sees).

The calibration tokens [S, T] run through the embedding; a pre-hook on decoder layer 0 records the hidden
states and the arguments the model passes its layers (position embeddings, mask). Then, per layer: hooks on
the dense target linears accumulate each input's Hessian H = sum x x^T / n (fp32 [K, K]) and keep a row
sample for AWQ; AWQ folds its scales; the layer is quantized (`quantize_model` with the method's
quantizer); and the *quantized* layer produces the next layer's inputs, so later layers compensate for
earlier layers' error. Only one layer's statistics and the hidden states [S, T, D] are alive at a time,
so this works on the streaming loader's meta-device skeleton (`fill` materialises each part in turn).
"""

from typing import Callable, Iterable

import torch
from rich.progress import Progress
from torch import nn

from ..nn import DEFAULT_TARGETS, LoraConfig
from ..quant import CALIBRATED, check_method, quantize_group
from .convert import FUSED_GROUPS, find_targets, quantize_model

AWQ_SAMPLE_ROWS = 4096  # input rows kept per linear for AWQ's search
BATCH_TOKENS = 8192  # calibration tokens per layer call


class _Captured(Exception):
    pass


def sibling_groups(names: Iterable[str]) -> list[list[str]]:
    """Module names grouped as fused siblings (q/k/v, gate/up under one parent); others alone, in order."""
    names, groups, seen = list(names), [], set()
    for name in names:
        if name in seen:
            continue
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), None)
        members = [name] if group is None else [f"{parent}.{s}" if parent else s for s in group
                                                if (f"{parent}.{s}" if parent else s) in names]
        groups.append(members)
        seen.update(members)
    return groups


def _input_sharers(name: str) -> list[str]:
    """`name` and every fused sibling name under the same parent (they all read the same input)."""
    parent, _, leaf = name.rpartition(".")
    group = next((g for g in FUSED_GROUPS if leaf in g), (leaf,))
    return [name] + [f"{parent}.{s}" if parent else s for s in group if s != leaf]


def method_quantizer(module: nn.Module, fmt: str, method: str, targets=DEFAULT_TARGETS,
                     hessians: dict[str, torch.Tensor] | None = None, skip: Iterable[str] = ()):
    """A `quantize_model` quantizer that quantizes each sibling group together with `method`.

    hessians: {module name (relative to `module`): fp32 [K, K]} for gptq; skip: names left unquantized."""
    skip = set(skip)
    names = [n for n in find_targets(module, targets) if n not in skip]
    group_of = {n: g for g in sibling_groups(names) for n in g}
    done: dict[str, dict] = {}

    def quantize(name, weight, _shared_global_scale):
        if name not in done:
            group = group_of[name]
            ws = [module.get_submodule(n).weight.detach() for n in group]
            h = next((hessians[n] for n in _input_sharers(group[0]) if n in (hessians or {})), None)
            done.update(zip(group, quantize_group(fmt, method, ws, h, name=group[0])))
        return done.pop(name)

    return quantize


def capture_layer_inputs(model: nn.Module, ids: torch.Tensor, device) -> list[tuple[torch.Tensor, dict]]:
    """[(hidden [B, T, D], layer kwargs)] per batch of calibration rows, as decoder layer 0 receives them."""
    layers = model.model.layers
    batches = []

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values", "past_key_value")}
        kwargs["use_cache"] = False
        batches.append((hidden.detach(), kwargs))
        raise _Captured

    rows = max(1, BATCH_TOKENS // ids.shape[1])
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for r0 in range(0, ids.shape[0], rows):
            try:
                model(input_ids=ids[r0:r0 + rows].to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return batches


def _layer_output(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def layer_statistics(layer: nn.Module, names: list[str], batches, total_rows: int) -> tuple[dict, dict]:
    """Run the dense `layer` on every batch; ({name: H fp32 [K, K]}, {name: input rows [<=4096, K]})."""
    sums, counts, samples = {}, {}, {}
    stride = max(1, -(-total_rows // AWQ_SAMPLE_ROWS))

    def hook_for(name):
        def hook(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.t() @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
            samples.setdefault(name, []).append(x[::stride].cpu())
        return hook

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        for hidden, kwargs in batches:
            _layer_output(layer, hidden, kwargs)
    finally:
        for h in handles:
            h.remove()
    hessians = {n: sums[n] / counts[n] for n in sums}
    return hessians, {n: torch.cat(s)[:AWQ_SAMPLE_ROWS] for n, s in samples.items()}


def _awq_fake_quant(fmt: str):
    from ..formats import get_format

    spec = get_format(fmt)

    def fake_quant(ws):
        return [spec.dequantize(**t, dtype=torch.float32) for t in quantize_group(fmt, "awq", ws)]
    return fake_quant


@torch.no_grad()
def calibrated_quantize(model: nn.Module, fmt: str, method: str, ids: torch.Tensor, lora: LoraConfig | None = None,
                        targets=DEFAULT_TARGETS, keep_bf16: Iterable[str] = (), device=None,
                        fill: Callable[[nn.Module, str], None] | None = None, show_progress: bool = False) -> dict:
    """Quantize every decoder layer of `model` (an HF causal LM) to `fmt` with a calibrated `method`.

    ids: int64 [S, T] calibration tokens; keep_bf16: full module names left in 16 bits; fill(module, prefix):
    materialise a meta-device part first (the streaming loader). Returns a summary
    {"tokens", "fallbacks", "awq_scales": {norm path: s fp32 [D]}}."""
    check_method(method, fmt)
    if method not in CALIBRATED:
        raise ValueError(f"{method!r} needs no calibration; use quantize_model(method=...)")
    device = torch.device(device or next(p.device for p in model.parameters() if not p.is_meta))
    body = model.model
    if fill is not None:
        fill(body.embed_tokens, "model.embed_tokens.")
    batches = capture_layer_inputs(model, ids, device)
    total_rows = ids.numel()
    keep = set(keep_bf16)
    awq_scales = {}
    with Progress(disable=not show_progress, transient=True) as progress:
        task = progress.add_task(f"calibrating + quantizing to {fmt} ({method})", total=len(body.layers))
        for i, layer in enumerate(body.layers):
            prefix = f"model.layers.{i}."
            if fill is not None:
                fill(layer, prefix)
            names = list(find_targets(layer, targets))
            skip = [n for n in names if prefix + n in keep]
            leaders = [g[0] for g in sibling_groups(names)]  # siblings share their input: one Hessian each
            hessians, samples = layer_statistics(layer, leaders, batches, total_rows)
            if method == "awq":
                from ..quant.awq import apply_awq

                leaf_samples = {n.rpartition(".")[2]: s.to(device) for n, s in samples.items()}
                for name, s in apply_awq(layer, leaf_samples, _awq_fake_quant(fmt)).items():
                    awq_scales[prefix + name] = s
                hessians = {}
            quantize_model(layer, fmt, lora, targets=[t for t in targets],
                           quantizer=method_quantizer(layer, fmt, method, targets, hessians, skip))
            del hessians, samples
            batches = [(_layer_output(layer, h, kw), kw) for h, kw in batches]
            progress.advance(task)
    if hasattr(model, "config"):
        model.config.qerl_weight_format = fmt
    return {"tokens": total_rows, "awq_scales": awq_scales}
