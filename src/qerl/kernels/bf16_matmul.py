"""y = x @ W^T (+ bias) (+ a LoRA term) for a 16-bit weight: the bf16 baseline's base matmul.

At decode sizes on CUDA (bf16, up to `triton_gate.BF16_SWAP_MAX_M` rows) the Gluon kernel `gluon_bf16` takes
it: one launch with split-K, bias and the LoRA term inside, and programmatic dependent launch in the rollout
engine's decode step. Everything else (CPU, fp32, more rows, no Gluon) is `F.linear` plus one in-place addmm.
"""

import warnings

import torch
import torch.nn.functional as F

from . import triton_gate
from .nvfp4_matmul import add_lora

# Widest LoRA rank sum the kernel's epilogue takes (its B tile lives in registers), as for the NVFP4 kernel
LORA_IN_KERNEL_MAX_R = 128
_GLUON: list = []  # [module or None]: `gluon_bf16`, imported on first use; None once it failed here


def _gluon():
    if not _GLUON:
        try:
            from . import gluon_bf16
        except (ImportError, AttributeError):  # no triton.experimental.gluon, or a different API
            gluon_bf16 = None
        _GLUON.append(gluon_bf16)
    return _GLUON[0]


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] -> x @ weight^T + bias (+ h @ b^T for lora = (h [..., R], b [N, R])), [..., N] in x.dtype.
    weight [N, K] (bf16 for the kernel path; any float dtype otherwise, cast to x.dtype as F.linear needs)."""
    m, n = triton_gate.rows(x), weight.shape[0]
    if (x.dtype == torch.bfloat16 and triton_gate.use_triton(x) and triton_gate.bf16_swap_wins(m, n, x.shape[-1])
            and (lora is None or lora[0].shape[-1] <= LORA_IN_KERNEL_MAX_R)):
        gk = _gluon()
        if gk is not None and gk.supported(x, weight):
            x2 = x.reshape(-1, x.shape[-1])
            lo = None if lora is None else (lora[0].reshape(-1, lora[0].shape[-1]), lora[1].contiguous())
            b = None if bias is None else bias.to(x.dtype).contiguous()
            try:
                y = gk.bf16_linear_swap(x2, weight, b, triton_gate.sm_count(x.device, 4), lora=lo)
                return y.reshape(*x.shape[:-1], n)
            except (ValueError, TypeError):  # bad arguments (e.g. LoRA operand shapes): the caller's error
                raise
            except Exception as e:  # a GPU or Triton build this kernel does not compile for
                if torch.cuda.is_current_stream_capturing():
                    raise
                warnings.warn(f"Gluon bf16 decode kernel unavailable here ({type(e).__name__}: {str(e)[:200]}); "
                              "using cuBLAS", RuntimeWarning, stacklevel=2)
                _GLUON[0] = None
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    return add_lora(F.linear(x, w, None if bias is None else bias.to(x.dtype)), lora)
