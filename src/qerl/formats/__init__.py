"""Weight formats: quantize / dequantize / pack in plain torch (CPU and CUDA), one module per format.

`FORMATS` maps a format name to a `WeightFormat`, the one description the layers, the model surgery and
the checkpoint writer read. Each format stores a weight as a dict of named tensors whose names are the
checkpoint names (`<module>.weight_packed`, ...).
"""

from dataclasses import dataclass
from typing import Callable

import torch

from . import fp8, mxfp4, nf4, nvfp4


@dataclass(frozen=True)
class WeightFormat:
    name: str  # the name layers store (`QuantLinear.weight_format`) and kernels dispatch on
    block: int  # input features per scale block; K must be a multiple
    tensor_names: tuple[str, ...]
    # quantize(w [N, K] float, global_scale fp32 [1] | None) -> {tensor name: tensor}
    quantize: Callable[..., dict[str, torch.Tensor]]
    # dequantize(**tensors, dtype=...) -> W [N, K]
    dequantize: Callable[..., torch.Tensor]
    # global_scale(w) -> fp32 [1]; set for formats whose fused siblings (q/k/v, gate/up) share one scale
    global_scale: Callable[[torch.Tensor], torch.Tensor] | None = None


def _quantize_dense(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"bf16: weight must be a 2-D float tensor, got {w.dtype} {tuple(w.shape)}")
    return {"weight": w.detach().to(torch.bfloat16)}


def _dequantize_dense(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return weight.to(dtype)


FORMATS: dict[str, WeightFormat] = {
    "nvfp4": WeightFormat(
        "nvfp4", nvfp4.BLOCK, nvfp4.TENSOR_NAMES, nvfp4.quantize_nvfp4, nvfp4.dequantize_nvfp4,
        nvfp4.nvfp4_global_scale,
    ),
    "mxfp4": WeightFormat("mxfp4", mxfp4.BLOCK, mxfp4.TENSOR_NAMES, mxfp4.quantize_mxfp4, mxfp4.dequantize_mxfp4),
    # NF4 blocks run over the flattened tensor (only K even and N*K % 64 == 0 are needed); block=64 is
    # the conservative per-row rule for callers that check K % block, and holds for every LLM layer.
    "nf4": WeightFormat("nf4", nf4.BLOCK, nf4.TENSOR_NAMES, nf4.quantize_nf4, nf4.dequantize_nf4),
    # 8-bit base: e4m3 codes, one fp32 scale per output channel (the FP8 RL peers use; any K)
    "fp8": WeightFormat("fp8", fp8.BLOCK, fp8.TENSOR_NAMES, fp8.quantize_fp8, fp8.dequantize_fp8),
    # 16-bit base: the ablation baseline (bf16 LoRA), same layer and code paths, no quantization.
    "bf16": WeightFormat("bf16", 1, ("weight",), _quantize_dense, _dequantize_dense),
}


def get_format(fmt: "str | WeightFormat") -> WeightFormat:
    """The format a name stands for; a WeightFormat is its own answer, so an entry point resolves a name once
    and hands the object on."""
    if isinstance(fmt, WeightFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {sorted(FORMATS)}") from None
