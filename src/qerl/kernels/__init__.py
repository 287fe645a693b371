"""Matmuls against quantized weights. Each entry point takes the format's tensors as stored.

`quantized_linear(fmt, x, tensors, bias)` is what the layers call; it dispatches to the format's entry
module (`nvfp4_matmul`, `mxfp4_matmul`, `bf16_matmul`; other formats dequantize in torch). Each entry asks
`route.route` for a backend over (format, M, N, K, device) under the scoped `route.KernelPolicy`: on CUDA
bf16/fp16 the Gluon kernels at decode sizes (`gluon.nvfp4` and its sm_90 form `gluon.nvfp4_wgmma`,
`gluon.bf16`), on sm_90 the warp-specialized ones at a few hundred rows (`gluon.nvfp4_wgmma_ws` forward,
`gluon.nvfp4_grad_input` for the input gradient) and the Triton kernels otherwise (`triton.fp4`: tl.dot with W
decoded in registers, the CUDA-core GEMV, one-pass dequantize + cuBLAS), imported only then, so CPU users need no
Triton. Everywhere
else the plain-torch path dequantizes the weight into a temporary freed when the call returns, so the 4-bit
tensors stay the only persistent copy.
The other operations, one entry module each: `decode_attention`, `fused_ops` (residual-add + RMSNorm, RoPE,
SiLU-mul), `lora_a`; sampling is `triton.sampling` behind `qerl.rollout.sampling`. Shared pieces: `operands`
(argument views), `workspace` (kernel buffers), `pdl` (programmatic dependent launch).
Layout: the entry modules and `route` here, the backends by language in `triton/` and `gluon/` (each imports
Triton: imported lazily), and the tuning data, `KernelPolicy`'s thresholds and the kernels' tile tables, as one
JSON file per device family in tuning/ (`route.TUNING_FILES`).
"""

from .dequant_cache import dense_weight_bytes, dequantized_weights
from .dispatch import quantized_linear, quantized_linear_grad_input
from .mxfp4_matmul import mxfp4_linear, mxfp4_linear_grad_input
from .nvfp4_matmul import nvfp4_linear, nvfp4_linear_grad_input

__all__ = ["dense_weight_bytes", "dequantized_weights", "quantized_linear", "quantized_linear_grad_input",
           "nvfp4_linear", "nvfp4_linear_grad_input", "mxfp4_linear", "mxfp4_linear_grad_input"]
