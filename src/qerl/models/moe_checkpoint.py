"""4-bit MoE experts (`QuantExperts`) in a quantized checkpoint: one set of tensors per expert and projection.

On disk each expert is three linears, as llm-compressor writes a Qwen3-MoE / Qwen2-MoE and as vLLM's
compressed-tensors MoE loader reads it; `<experts>` is the experts module's path (`model.layers.N.mlp.experts`):

    nvfp4 / mxfp4 (compressed-tensors):
        <experts>.{e}.gate_proj.weight_packed  uint8 [I, H/2]   <experts>.{e}.up_proj.weight_packed  [I, H/2]
        <experts>.{e}.gate_proj.weight_scale         [I, H/g]   <experts>.{e}.up_proj.weight_scale   [I, H/g]
        <experts>.{e}.gate_proj.weight_global_scale  fp32 [1]   (nvfp4 only; gate and up hold the same value)
        <experts>.{e}.down_proj.weight_packed  uint8 [H, I/2], .weight_scale [H, I/g], .weight_global_scale [1]
    nf4 (bitsandbytes serialization, as for dense linears):
        <experts>.{e}.{gate,up,down}_proj.weight (packed, [N*K/2, 1]), .weight.absmax, .weight.quant_map,
        .weight.quant_state.bitsandbytes__nf4

Each tensor is a slice of QuantExperts' stacked buffers (its module docstring): gate_proj is rows [:I] of
gate_up_proj's, up_proj rows [I:], NVFP4's per-expert global scale goes to both; NF4's absmax, whose blocks
run over the flattened [2I, H] matrix, splits at I*H/64. Loading concatenates them back, so a save / load
round trip gives bit-identical buffers. A checkpoint in which an expert's gate and up global scales differ
(another tool's) is refused: QuantExperts holds one per expert for the fused gate_up.

Only the Qwen layout (`QuantExperts` itself) is written this way; subclasses with another layout (gpt-oss's
interleaved gate/up rows and biases) are refused by `check_saveable_experts`.
"""

import json

import torch
from torch import nn

from ..formats import get_format
from ..nn.quant_experts import QuantExperts
from .sources import ModelLoadError

QWEN_EXPERTS = ("Qwen3MoeExperts", "Qwen2MoeExperts")  # the HF classes whose layout this file reads
BNB_STATE = "quant_state.bitsandbytes__nf4"


def check_saveable_experts(experts: dict[str, QuantExperts]) -> None:
    """ValueError naming the first experts module whose layout has no per-expert checkpoint form here."""
    for name, m in experts.items():
        if type(m) is not QuantExperts:
            raise ValueError(f"cannot save a quantized checkpoint of {name} ({type(m).__name__}): only the "
                             "Qwen3-MoE / Qwen2-MoE experts layout (QuantExperts) has a per-expert checkpoint form "
                             "yet. Save the LoRA adapter (save_adapter) and quantize the base again on load")


def _rows(fmt: str, tensor: str, t: torch.Tensor, start: int, stop: int, k: int) -> torch.Tensor:
    """Rows [start, stop) of one expert's format tensor `t` for a matrix with `k` input features: row-sliced,
    except a global scale (shared) and NF4's flat absmax (blocks of 64 over the flattened matrix)."""
    if tensor == "weight_global_scale":
        return t
    if fmt == "nf4" and tensor == "weight_absmax":
        per_row = k // get_format("nf4").block
        return t[start * per_row:stop * per_row]
    return t[start:stop]


def _bnb(prefix: str, packed: torch.Tensor, absmax: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
    """One NF4 matrix [n, k] in the bitsandbytes serialization that transformers reads for dense linears."""
    from ..formats.nf4 import NF4_CODE

    meta = {"quant_type": "nf4", "blocksize": get_format("nf4").block, "dtype": "bfloat16", "shape": [n, k]}
    return {
        f"{prefix}.weight": packed.reshape(-1, 1),
        f"{prefix}.weight.absmax": absmax,
        f"{prefix}.weight.quant_map": torch.tensor(NF4_CODE, dtype=torch.float32),
        f"{prefix}.weight.{BNB_STATE}": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8),
    }


def expert_tensors(name: str, quant: QuantExperts) -> dict[str, torch.Tensor]:
    """The on-disk tensors (module docstring) of the experts module `quant` at path `name`, each a CPU copy of
    its own (safetensors refuses tensors sharing memory, as slices of one buffer and the shared global scale do)."""
    fmt, E, H, I = quant.weight_format, quant.num_experts, quant.hidden_dim, quant.intermediate_dim  # noqa: E741
    out = {}
    for e in range(E):
        gate_up, down = (quant._expert_tensors(w, e) for w in ("gate_up_proj", "down_proj"))
        parts = {"gate_proj": (gate_up, 0, I, H), "up_proj": (gate_up, I, 2 * I, H), "down_proj": (down, 0, H, I)}
        for proj, (tensors, start, stop, k) in parts.items():
            sliced = {t: _rows(fmt, t, v, start, stop, k) for t, v in tensors.items()}
            prefix = f"{name}.{e}.{proj}"
            if fmt == "nf4":
                out.update(_bnb(prefix, sliced["weight_packed"], sliced["weight_absmax"], stop - start, k))
            else:
                out.update({f"{prefix}.{t}": v for t, v in sliced.items()})
    return {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def has_expert_tensors(state: dict, name: str, fmt: str) -> bool:
    """Whether `state` holds per-expert 4-bit tensors in `fmt` for the experts module at `name` (expert 0's
    gate_proj; dense per-expert weights, e.g. of experts another tool left unquantized, do not count)."""
    key = f"{name}.0.gate_proj.weight.{BNB_STATE}" if fmt == "nf4" else f"{name}.0.gate_proj.weight_packed"
    return key in state


def _take(state: dict, prefix: str, fmt: str, n: int, k: int, path) -> dict[str, torch.Tensor]:
    """Pop one expert projection's format tensors out of `state`, as QuantLinear would hold them for [n, k]."""
    if fmt == "nf4":
        keys = [f"{prefix}.weight", f"{prefix}.weight.absmax", f"{prefix}.weight.{BNB_STATE}"]
        missing = [key for key in keys if key not in state]
        if missing:
            raise ModelLoadError(f"{path}: checkpoint lacks {missing[0]}")
        packed, absmax = state.pop(keys[0]), state.pop(keys[1])
        meta = json.loads(bytes(state.pop(keys[2]).tolist()))
        state.pop(f"{prefix}.weight.quant_map", None)
        if list(meta["shape"]) != [n, k]:
            raise ModelLoadError(f"{path}: {prefix} has shape {meta['shape']}, the model needs {[n, k]}")
        return {"weight_packed": packed.reshape(n, k // 2), "weight_absmax": absmax.float()}
    names = get_format(fmt).tensor_names
    missing = [t for t in names if f"{prefix}.{t}" not in state]
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks {prefix}.{missing[0]} (format {fmt})")
    state.pop(f"{prefix}.input_global_scale", None)  # W4A4 checkpoints: activations stay 16-bit here
    tensors = {t: state.pop(f"{prefix}.{t}") for t in names}
    if tensors["weight_packed"].shape != (n, k // 2):
        raise ModelLoadError(f"{path}: {prefix}.weight_packed has shape {tuple(tensors['weight_packed'].shape)}, "
                             f"the model needs {(n, k // 2)}")
    return tensors


def take_experts(state: dict, name: str, hf_experts: nn.Module, fmt: str, path) -> QuantExperts:
    """Pop the per-expert tensors of the experts module at `name` out of a checkpoint state dict and stack them
    into a QuantExperts shaped like `hf_experts` (the model's own, possibly on the meta device)."""
    from .experts import check_experts_layout

    check_experts_layout(name, hf_experts)
    if type(hf_experts).__name__ not in QWEN_EXPERTS:
        raise ModelLoadError(f"{path}: per-expert 4-bit tensors of {name} ({type(hf_experts).__name__}) cannot be "
                             f"loaded; only {', '.join(QWEN_EXPERTS)} are")
    E, two_i, H = hf_experts.gate_up_proj.shape
    I = two_i // 2  # noqa: E741
    gate_up, down = [], []
    for e in range(E):
        g, u, d = (_take(state, f"{name}.{e}.{proj}", fmt, n, k, path)
                   for proj, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)))
        fused = {}
        for t in g:
            if t == "weight_global_scale":
                if not torch.equal(g[t], u[t]):
                    raise ModelLoadError(f"{path}: {name}.{e}: gate_proj and up_proj have different global scales "
                                         f"({g[t].tolist()} vs {u[t].tolist()}); qerl's experts share one per expert")
                fused[t] = g[t]
            else:
                fused[t] = torch.cat([g[t], u[t]])
        gate_up.append(fused)
        down.append(d)
    stacked = [{t: torch.stack([x[t] for x in per]) for t in per[0]} for per in (gate_up, down)]
    return QuantExperts(E, H, I, fmt, hf_experts.act_fn, *stacked)
