"""Matmuls against quantized weights. Each entry point takes the format's tensors as stored.

`quantized_linear(fmt, x, tensors, bias)` is what the layers call; it dispatches to the format's entry
point (`nvfp4_linear`, `mxfp4_linear`, `bf16_linear`, ...). CUDA bf16/fp16 inputs of the FP4 formats go to
Triton/Gluon kernels (imported only then, so CPU users need no Triton): dequant-in-registers for decode sizes
(NVFP4: the Gluon swap-AB kernels `gluon_nvfp4` / `gluon_nvfp4_wgmma`), one-pass device dequantize + cuBLAS
above (see `triton_gate`); the 16-bit baseline's decode-sized products take `gluon_bf16`.
`fused_ops` holds the rollout engine's fused residual-add + RMSNorm and RoPE. Everywhere else the fallback dequantizes the
weight into a temporary that is freed when the call returns, so the 4-bit tensors stay the only persistent copy.
"""

from .dequant_cache import dequantized_weights
from .dispatch import quantized_linear, quantized_linear_grad_input
from .mxfp4_matmul import mxfp4_linear, mxfp4_linear_grad_input
from .nvfp4_matmul import nvfp4_linear, nvfp4_linear_grad_input

__all__ = ["dequantized_weights", "quantized_linear", "quantized_linear_grad_input", "nvfp4_linear", "nvfp4_linear_grad_input",
           "mxfp4_linear", "mxfp4_linear_grad_input"]
