"""When to take the Triton path, decided without importing Triton (CPU users may not have it).

The fused kernels run when the activation is a CUDA bf16/fp16 tensor and Triton can be imported.
QERL_DISABLE_TRITON=1 forces the plain-torch reference path (debugging, benchmarks).
FUSED_MAX_M: above this many rows the forward dequantizes W once on the device (one Triton pass into a
temporary the caching allocator reuses) and calls cuBLAS; set from the measurements in docs/benchmarks.md.
"""

import importlib.util
import os

import torch

FUSED_MAX_M = 1 << 62  # no fallback until measured otherwise
GRAD_FUSED_MAX_M = 1 << 62
_HAVE_TRITON: bool | None = None


def triton_available() -> bool:
    global _HAVE_TRITON
    if _HAVE_TRITON is None:
        _HAVE_TRITON = importlib.util.find_spec("triton") is not None
    return _HAVE_TRITON


def use_triton(x: torch.Tensor) -> bool:
    """True when x should go through the Triton kernels."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("QERL_DISABLE_TRITON", "0") != "1" and triton_available())


def rows(x: torch.Tensor) -> int:
    """Number of rows M of x viewed as [M, features]."""
    return x.numel() // max(1, x.shape[-1])
