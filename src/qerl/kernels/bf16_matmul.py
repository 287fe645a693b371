"""y = x @ W^T (+ bias) (+ a LoRA term) for a 16-bit weight: the bf16 baseline's base matmul.

The public entry for 16-bit weights. `route.route` sends decode sizes on CUDA (bf16, up to
`KernelPolicy.bf16_swap_max_m` rows) to the Gluon kernel `gluon.bf16`: one launch with split-K, bias and the
LoRA term inside, and programmatic dependent launch in the rollout engine's decode step. Everything else
(CPU, fp32, more rows, no Gluon) is `F.linear` plus one in-place addmm.
"""

import warnings

import torch
import torch.nn.functional as F

from . import route as rt
from .operands import add_lora


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] -> x @ weight^T + bias (+ h @ b^T for lora = (h [..., R], b [N, R])), [..., N] in x.dtype.
    weight [N, K] (bf16 for the kernel path; any float dtype otherwise, cast to x.dtype as F.linear needs)."""
    m, n, k = rt.rows(x), weight.shape[0], x.shape[-1]
    backend = rt.route("bf16", m, n, k, rt.kernel_capability(x), dtype=x.dtype,
                       lora_r=0 if lora is None else lora[0].shape[-1], unavailable=rt.unavailable())
    if backend == rt.GLUON_BF16:
        y = _gluon_linear(x, weight, bias, lora)
        if y is not None:
            return y
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    return add_lora(F.linear(x, w, None if bias is None else bias.to(x.dtype)), lora)


def _gluon_linear(x, weight, bias, lora):
    """`gluon.bf16`, or None when the weight's layout does not suit it (see `gluon.bf16.supported`) or this
    Triton / GPU cannot build it (then marked unavailable for the process, with a warning)."""
    try:
        from .gluon import bf16 as gluon_bf16
    except (ImportError, AttributeError) as e:  # no triton.experimental.gluon, or a different API
        warnings.warn(f"Gluon bf16 decode kernel unavailable here ({type(e).__name__}: {str(e)[:200]}); "
                      "using cuBLAS", RuntimeWarning, stacklevel=3)
        rt.mark_unavailable(rt.GLUON_BF16)
        return None
    if not gluon_bf16.supported(x, weight):
        return None
    x2 = x.reshape(-1, x.shape[-1])
    lo = None if lora is None else (lora[0].reshape(-1, lora[0].shape[-1]), lora[1].contiguous())
    b = None if bias is None else bias.to(x.dtype).contiguous()
    try:
        y = gluon_bf16.bf16_linear_swap(x2, weight, b, rt.sm_count(x.device, 4), lora=lo)
    except (ValueError, TypeError):  # bad arguments (e.g. LoRA operand shapes): the caller's error
        raise
    except Exception as e:  # a GPU or Triton build this kernel does not compile for
        if torch.cuda.is_current_stream_capturing():
            raise
        warnings.warn(f"Gluon bf16 decode kernel unavailable here ({type(e).__name__}: {str(e)[:200]}); "
                      "using cuBLAS", RuntimeWarning, stacklevel=3)
        rt.mark_unavailable(rt.GLUON_BF16)
        return None
    return y.reshape(*x.shape[:-1], weight.shape[0])
