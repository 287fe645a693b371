"""Argument preparation shared by the matmul entry points and their backends (imports no Triton).

The kernels take the format's tensors as stored; these turn them into the views the launchers want and
decide, once per weight, whether the NVFP4 global scale allows the fast bf16 decode step.
"""

import torch

# The inline-PTX decode multiplies by step * 2^126 in bf16; E4M3 scales are <= 448, so it is finite when
# global_scale > 448 * 2^126 / bf16_max = 112.4 (weights with amax below ~24). 128 leaves a margin.
ASM_MIN_GLOBAL_SCALE = 128.0
_FITS_ATTR = "_qerl_bf16_step_fits"  # cached on the global-scale tensor object itself


def step_fits_bf16(weight_global_scale: torch.Tensor) -> bool:
    """Whether this tensor's global scale allows the fast bf16 decode; read from the device ONCE per tensor
    (a one-time sync, cached on the tensor object with its version counter, so a load_state_dict copy
    into it is seen; this is the kernels' only load-time prepare step). False while a CUDA
    graph is being captured and the value is not cached yet (no sync allowed then)."""
    hit = getattr(weight_global_scale, _FITS_ATTR, None)
    if hit is not None and hit[0] == weight_global_scale._version:  # in-place writes bump _version
        return hit[1]
    if weight_global_scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    v = float(weight_global_scale.detach().float().reshape(-1)[0])
    fits = ASM_MIN_GLOBAL_SCALE < v < float("inf")
    setattr(weight_global_scale, _FITS_ATTR, (weight_global_scale._version, fits))
    return fits


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """t [..., C] as [rows, C] with unit column stride (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor as uint8 with unit column stride (E4M3 bits: a free view)."""
    s = scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)
    return s if s.stride(-1) == 1 else s.contiguous()


def global_scale_f32(weight_global_scale: torch.Tensor) -> torch.Tensor:
    return weight_global_scale.reshape(1).float().contiguous()


def add_lora(y: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """y [..., N] + h @ b^T for lora = (h [..., R], b [N, R]) as one addmm (y unchanged when lora is None).

    y must be a fresh result the caller owns (every caller passes its matmul's output): the sum is written
    into it. In place because an out-of-place addmm first copies y into a new tensor (one extra device copy
    per call); same cuBLAS product, same bits."""
    if lora is None:
        return y
    h, b = lora
    y2 = y.reshape(-1, y.shape[-1])
    return y2.addmm_(h.reshape(-1, h.shape[-1]), b.t()).view(y.shape)
