"""Quantization methods: how a weight's codes and scales are chosen, in the unchanged storage formats.

  rtn     round-to-nearest, no data (bit-exact with compressed-tensors / bitsandbytes); every format
  4over6  NVFP4 block scales chosen by squared error among E4M3 values around round-to-nearest's, up to
          "maximum onto 4" (`nvfp4_scales`); no data
  gptq    GPTQ column rounding with inverse-Hessian error feedback onto the NVFP4 grid (`gptq`); needs
          calibration data
  awq     activation-aware per-input-channel scaling folded into the preceding norm / linear (`awq`), then
          the format's best calibration-free rounding; needs calibration data
Each method writes the format's ordinary tensors, so loaders, kernels, exports and vLLM are unaffected.
"""

import warnings

import torch

from ..choices import METHODS  # the methods (and the config's model.quant_method)
from ..formats import FORMATS, WeightFormat, get_format
from .gptq import HessianError, gptq_nvfp4
from .nvfp4_scales import quantize_nvfp4_searched

CALIBRATED = ("gptq", "awq")
SUPPORTED_FORMATS = {"rtn": tuple(FORMATS), "4over6": ("nvfp4",), "gptq": ("nvfp4",),
                     "awq": ("nvfp4", "mxfp4", "nf4")}
NVFP4_SEARCH = "mse"  # the scale candidates `4over6` tries (nvfp4_scales.candidate_scales)


def check_method(method: str, fmt: str | WeightFormat) -> None:
    """ValueError for an unknown method or one that does not apply to `fmt` (a format, or its name: an unknown
    name is `get_format`'s to refuse)."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    name = fmt if isinstance(fmt, str) else fmt.name
    if name not in SUPPORTED_FORMATS[method]:
        raise ValueError(f"quantization method {method!r} works on {', '.join(SUPPORTED_FORMATS[method])}, "
                         f"not {name!r}")


def quantize_group(fmt: str | WeightFormat, method: str, ws: list[torch.Tensor], hessian: torch.Tensor | None = None,
                   name: str = "", search: str = NVFP4_SEARCH) -> list[dict[str, torch.Tensor]]:
    """`quantize_weights` for a format or its name, the method checked against it first (`check_method`)."""
    fmt = get_format(fmt)
    check_method(method, fmt)
    return quantize_weights(fmt, method, ws, hessian, name, search)


def quantize_weights(fmt: WeightFormat, method: str, ws: list[torch.Tensor], hessian: torch.Tensor | None = None,
                     name: str = "", search: str = NVFP4_SEARCH) -> list[dict[str, torch.Tensor]]:
    """Quantize weights [N_i, K] that share one input (and, for NVFP4, one global scale) with `method`, already
    checked against `fmt` (`check_method`, as `Quantization.of` does once for a whole load).

    hessian: fp32 [K, K] calibration Hessian of the shared input (gptq only). For awq the weights are
    expected already scaled (`qerl.quant.awq.apply_awq`); the rounding is then the calibration-free best.
    search: the NVFP4 scale candidates of 4over6 / gptq / awq (`nvfp4_scales.candidate_scales`).
    Returns one tensor dict per weight, in the format's checkpoint names."""
    if method == "rtn" or (method == "awq" and fmt.name != "nvfp4"):
        gs = None
        if fmt.global_scale is not None:
            gs = torch.stack([fmt.global_scale(w) for w in ws]).amin(0)
        return [fmt.quantize(w, None if gs is None else gs.clone()) for w in ws]
    if method == "gptq":
        if hessian is None:
            raise ValueError(f"{name or 'gptq'}: no calibration Hessian (gptq needs calibration data)")
        gs = quantize_nvfp4_searched(ws, search)[0]["weight_global_scale"]
        try:
            whole = gptq_nvfp4(torch.cat([w.float() for w in ws]), hessian, gs, search=search)
        except HessianError as e:
            warnings.warn(f"{name}: {e}; falling back to the calibration-free 4over6 scale search", stacklevel=2)
            return quantize_nvfp4_searched(ws, search)
        return _split_rows(whole, [w.shape[0] for w in ws])
    return quantize_nvfp4_searched(ws, search)


def _split_rows(tensors: dict[str, torch.Tensor], rows: list[int]) -> list[dict[str, torch.Tensor]]:
    """Tensors of concatenated weights -> one dict per weight (per-row tensors split, scalars shared)."""
    out = [{} for _ in rows]
    total = sum(rows)
    for key, t in tensors.items():
        parts = t.split(rows) if t.dim() and t.shape[0] == total else [t.clone() for _ in rows]
        for d, p in zip(out, parts):
            d[key] = p.contiguous()
    return out
