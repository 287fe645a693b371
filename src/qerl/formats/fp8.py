"""FP8 weights: e4m3 codes with one fp32 scale per output channel (compressed-tensors "float-quantized",
channel strategy, the layout vLLM serves).

    W[n, k] ~= weight[n, k] * weight_scale[n, 0]     weight float8_e4m3fn [N, K], weight_scale fp32 [N, 1]

The scale maps each row's absolute maximum onto e4m3's largest finite value (448, `e4m3_scale`); the codes are
torch's cast to float8_e4m3fn (round to nearest even) of the scaled row, so the row maximum gets the code 448. An
all-zero row gets scale 1 and zero codes. Activations are quantized per token when the matmul runs on FP8 tensor cores
(`qerl.kernels.fp8_matmul`); this module only stores weights.
"""

import torch

from .errors import check_weight
from .fp4 import decode_e2m1, unpack_fp4
from .nvfp4 import BLOCK as NVFP4_BLOCK

BLOCK = 1  # one scale per output channel: any K
TENSOR_NAMES = ("weight", "weight_scale")
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def e4m3_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax [..., 1] -> the scale mapping it onto 448: amax times fp32(1/448) (1 where amax is 0). A
    multiply, not a division: torch's CUDA division by a scalar multiplies by its reciprocal, its CPU division
    does not, so this form is the one every device (and the Triton kernel) computes bit for bit."""
    return torch.where(amax > 0, amax * (1.0 / E4M3_MAX), torch.ones_like(amax))


def quantize_fp8(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """w [N, K] float -> {"weight": float8_e4m3fn [N, K], "weight_scale": fp32 [N, 1]}. global_scale: unused (the
    per-channel scale is fp32)."""
    check_weight(w, BLOCK, "fp8")
    w = w.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = e4m3_scale(amax)
    codes = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored tensors -> W [N, K] in dtype (the product formed in fp32, then rounded once)."""
    return (weight.float() * weight_scale.float()).to(dtype)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations per token: x [M, K] float -> (float8_e4m3fn [M, K], fp32 scale [M, 1]) as `quantize_fp8` does
    for weight rows (x ~= codes * scale)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = e4m3_scale(amax)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp4_row_shift(fmt: str, weight_scale: torch.Tensor) -> torch.Tensor:
    """The per-row power of two a W4A8 product divides a 4-bit row by before rounding it to e4m3: the smallest
    2^j with 6 x (the row's largest block scale) / 2^j <= 448, fp32 [N, 1].

    6 is E2M1's largest magnitude, so no value of the row can exceed 448 after the shift, and round-to-nearest
    NVFP4 / MXFP4 put a 6 in the block of the largest scale, so the row's largest value lands in (224, 448]:
    e4m3's whole range. Read from the scales alone (N x K/16 bytes), so a kernel can take it without decoding
    the row first. weight_scale: NVFP4 float8_e4m3fn (or its uint8 bits) [N, K/16]; MXFP4 uint8 E8M0 exponents
    [N, K/32]. An all-zero row gets shift 1; none is below 2^-126."""
    if fmt == "nvfp4":
        s = (weight_scale if weight_scale.dtype != torch.uint8 else weight_scale.view(torch.float8_e4m3fn)).float()
        top = s.abs().amax(dim=1, keepdim=True)
    elif fmt == "mxfp4":
        top = torch.exp2(weight_scale.amax(dim=1, keepdim=True).float() - 127.0)
    else:
        raise ValueError(f"FP8 compute takes nvfp4 or mxfp4 weights, not {fmt}")
    bound = top * (6.0 / E4M3_MAX)
    # frexp, not ceil(log2): exact for every float (bound = m * 2^e, m in [0.5, 1)), so no row can land above 448
    m, e = torch.frexp(bound)
    e = torch.where(m == 0.5, e - 1, e)
    # at least 2^-126 (a normal float): a kernel multiplies by 1 / shift, which must stay finite
    shift = torch.ldexp(torch.ones_like(bound), e.clamp(min=-126))
    return torch.where(bound > 0, shift, torch.ones_like(bound))


def nvfp4_as_fp8(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """NVFP4 tensors -> the fp8 format's tensors a W4A8 product multiplies: each E2M1 code times its E4M3 block
    scale (exact in fp32, up to 6 significant bits) divided by the row's power-of-two shift (`fp4_row_shift`)
    and rounded to e4m3 (nearest even); the shift over the global scale is the row's fp32 scale.
    {"weight": float8_e4m3fn [N, K], "weight_scale": fp32 [N, 1]}; benchmarks/w4a8_weights.py measures the
    rounding (about 4% of NVFP4's own error). On the GPU `qerl.kernels.triton.w4a8.fp4_to_e4m3` decodes to these
    same codes."""
    codes = unpack_fp4(weight_packed)
    n, k = codes.shape
    v = (decode_e2m1(codes).reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
         * weight_scale.float().unsqueeze(-1)).reshape(n, k)
    shift = fp4_row_shift("nvfp4", weight_scale)
    return {"weight": (v / shift).to(torch.float8_e4m3fn),
            "weight_scale": shift / weight_global_scale.float().reshape(1, 1)}


def mxfp4_as_fp8(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP4 tensors -> fp8 tensors: an E2M1 code times a power-of-two (E8M0) scale converts to e4m3 exactly while
    the row's scales span e4m3's range (a block more than 2^17 below the row's largest falls into its
    subnormals). Shift as in `fp4_row_shift`. {"weight": float8_e4m3fn [N, K], "weight_scale": fp32 [N, 1]}."""
    from .mxfp4 import dequantize_mxfp4

    shift = fp4_row_shift("mxfp4", weight_scale)
    return {"weight": (dequantize_mxfp4(weight_packed, weight_scale) / shift).to(torch.float8_e4m3fn),
            "weight_scale": shift}


def as_fp8(fmt: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A 4-bit format's tensors as the fp8 tensors a W4A8 product multiplies (`nvfp4_as_fp8`, `mxfp4_as_fp8`)."""
    if fmt == "nvfp4":
        return nvfp4_as_fp8(**tensors)
    if fmt == "mxfp4":
        return mxfp4_as_fp8(**tensors)
    raise ValueError(f"FP8 compute takes nvfp4 or mxfp4 weights, not {fmt}")
