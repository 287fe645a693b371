"""y = x @ W^T and its input gradient for an NVFP4 weight, without keeping W in 16 bits.

The public entry for NVFP4 products. `route.route` picks the backend from (M, N, K, device, dtype) under the
current `KernelPolicy`: the Gluon swap-AB kernels (`gluon.nvfp4`) at decode sizes, the Gluon input-gradient
kernel (`gluon.nvfp4_grad_input`) for dY @ W at a few hundred rows, the Triton kernels
(`triton.fp4`: tl.dot with W decoded in registers, the CUDA-core GEMV, or a one-pass dequantize followed by
cuBLAS) otherwise on CUDA, and on the CPU the plain-torch path, which is also the reference the kernels are
tested against: dequantize into a temporary that lives for this call only (speed matters less there than
staying small). Triton and Gluon are imported only when a kernel backend runs.
"""

import importlib
import warnings

import torch
import torch.nn.functional as F

from ..formats.nvfp4 import dequantize_nvfp4
from . import route as rt
from .operands import add_lora, step_fits_bf16


def nvfp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) -> [..., N] in x.dtype.

    weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_global_scale fp32 [1].
    lora: optional (h [..., R], b [N, R]) in x.dtype: adds h @ b^T (a LoRA delta with h = x @ A^T and
    b = scaling * B), inside the Gluon kernel's launch where it can, else as one addmm.
    """
    w = (weight_packed, weight_scale, weight_global_scale)
    m, n, k = rt.rows(x), weight_packed.shape[0], weight_packed.shape[1] * 2
    cap = rt.kernel_capability(x)
    lora_r = 0 if lora is None else lora[0].shape[-1]
    fits = cap is not None and step_fits_bf16(weight_global_scale)
    while True:
        backend = rt.route("nvfp4", m, n, k, cap, dtype=x.dtype, lora_r=lora_r, step_fits=fits,
                          unavailable=rt.unavailable())
        if backend not in rt.GLUON_NVFP4:
            return add_lora(_linear(backend, x, *w, bias), lora)
        y = _gluon_linear(backend, x, *w, bias, lora)
        if y is not None:
            return y


def _linear(backend: str, x, weight_packed, weight_scale, weight_global_scale, bias):
    if backend == rt.TORCH_DEQUANTIZE:
        w = dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    from .triton import fp4 as tk

    if backend == rt.TRITON_GEMV:
        return tk.nvfp4_linear_gemv(x, weight_packed, weight_scale, weight_global_scale, bias)
    if backend == rt.TRITON_DOT:
        return tk.nvfp4_linear_triton(x, weight_packed, weight_scale, weight_global_scale, bias)
    w = tk.nvfp4_dequantize_triton(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def _gluon_linear(backend: str, x, weight_packed, weight_scale, weight_global_scale, bias, lora):
    """The routed Gluon kernel, or None after marking it unavailable when this Triton / GPU cannot build it
    (then the caller routes again)."""
    if backend == rt.GLUON_WGMMA_WS:
        return _gluon_ws_linear(x, weight_packed, weight_scale, weight_global_scale, bias, lora)
    try:
        from .gluon import nvfp4 as gluon_nvfp4
    except (ImportError, AttributeError) as e:  # no triton.experimental.gluon, or a different API
        return _unavailable(e, "Gluon NVFP4 kernels", *rt.GLUON_NVFP4)
    try:
        return gluon_nvfp4.nvfp4_linear_gluon(x, weight_packed, weight_scale, weight_global_scale, bias,
                                              wgmma=backend != rt.GLUON_MMA, lora=lora,
                                              x_permuted=backend == rt.GLUON_WGMMA_XP)
    except (ValueError, TypeError):  # bad arguments (e.g. LoRA operand shapes): the caller's error
        raise
    except Exception as e:  # a GPU or Triton build this kernel does not compile for (shared memory, API)
        if _capturing():
            raise
        if backend == rt.GLUON_MMA:
            return _unavailable(e, "Gluon NVFP4 decode kernel", *rt.GLUON_NVFP4)
        return _unavailable(e, "wgmma form of the Gluon NVFP4 decode kernel", rt.GLUON_WGMMA, rt.GLUON_WGMMA_XP)


def _gluon_ws_linear(x, weight_packed, weight_scale, weight_global_scale, bias, lora):
    """The warp-specialized kernel, or None after marking it unavailable (no warp_specialize / TMA in this
    Triton, or a build that fails here); the other Gluon kernels stay routable."""
    return _call_or_mark("gluon.nvfp4_wgmma_ws", "warp-specialized Gluon NVFP4 kernel", rt.GLUON_WGMMA_WS,
                         lambda mod: mod.nvfp4_linear_ws_gluon(x, weight_packed, weight_scale, weight_global_scale,
                                                               bias, lora))


def _gluon_grad_input(grad_out, weight_packed, weight_scale, weight_global_scale):
    """The Gluon input-gradient kernel, or None after marking it unavailable (as `_gluon_ws_linear`)."""
    return _call_or_mark("gluon.nvfp4_grad_input", "Gluon NVFP4 input-gradient kernel", rt.GLUON_GRAD_INPUT,
                         lambda mod: mod.nvfp4_grad_input_gluon(grad_out, weight_packed, weight_scale,
                                                                weight_global_scale))


def _call_or_mark(module: str, what: str, backend: str, call):
    """call(the kernel module) for one warp-specialized backend; None after marking `backend` unavailable when
    the module does not import (Triton without its Gluon API) or the launch fails to build here. Bad arguments
    (ValueError, TypeError) are the caller's error and propagate, as does any failure inside a graph capture."""
    try:
        mod = importlib.import_module(f".{module}", __package__)
    except (ImportError, AttributeError) as e:
        return _unavailable(e, what, backend)
    try:
        return call(mod)
    except (ValueError, TypeError):
        raise
    except Exception as e:
        if _capturing():
            raise
        return _unavailable(e, what, backend)


def _capturing() -> bool:
    """Inside a CUDA graph capture (where a failure must surface, not be routed around). CPU builds of torch
    cannot ask, and capture nothing."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _unavailable(e: Exception, what: str, *backends: str) -> None:
    warnings.warn(f"{what} unavailable here ({type(e).__name__}: {str(e)[:200]}); routing around it",
                  RuntimeWarning, stacklevel=4)
    rt.mark_unavailable(*backends)
    return None


def nvfp4_linear_grad_input(
    grad_out: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
) -> torch.Tensor:
    """grad_out [..., N] -> grad_out @ W, [..., K] in grad_out.dtype."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    cap = rt.kernel_capability(grad_out)
    fits = cap is not None and step_fits_bf16(weight_global_scale)
    backend = rt.route("nvfp4", rt.rows(grad_out), n, k, cap, op="grad_input", dtype=grad_out.dtype, step_fits=fits,
                      unavailable=rt.unavailable())
    if backend == rt.GLUON_GRAD_INPUT:
        y = _gluon_grad_input(grad_out, weight_packed, weight_scale, weight_global_scale)
        if y is not None:
            return y
        backend = rt.route("nvfp4", rt.rows(grad_out), n, k, cap, op="grad_input", dtype=grad_out.dtype,
                          step_fits=fits, unavailable=rt.unavailable())
    if backend == rt.TORCH_DEQUANTIZE:
        return grad_out @ dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, dtype=grad_out.dtype)
    from .triton import fp4 as tk

    if backend == rt.TRITON_DOT:
        return tk.nvfp4_grad_input_triton(grad_out, weight_packed, weight_scale, weight_global_scale)
    return grad_out @ tk.nvfp4_dequantize_triton(weight_packed, weight_scale, weight_global_scale,
                                                 dtype=grad_out.dtype)
