"""Fused FP4 x bf16 products on the GPU (Hopper has no FP4 tensor cores: dequantize in registers).

Public functions take the format's tensors exactly as stored (compressed-tensors layout, no re-packing):
  nvfp4_linear_triton(x, weight_packed, weight_scale, weight_global_scale, bias)  x [..., K] -> [..., N]
  nvfp4_grad_input_triton(grad_out, weight_packed, weight_scale, weight_global_scale)  [..., N] -> [..., K]
  mxfp4_linear_triton / mxfp4_grad_input_triton: same with uint8 E8M0 scales per 32 and no global scale.
Inputs must be bf16 or fp16 with K % 16 == 0 (K % 32 for MXFP4). The tile shape is picked from (M, N, K)
by `pick_config`; see `triton_fp4_mm` for the kernels. This module imports Triton: import it lazily.
"""

import warnings

import torch

from . import triton_gate
from .triton_fp4_gemv import GemvConfig, fp4_gemv
from .triton_fp4_mm import TileConfig, fp4_dequantize, fp4_grad_input, fp4_linear

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# The inline-PTX decode multiplies by step * 2^126 in bf16; E4M3 scales are <= 448, so it is finite when
# global_scale > 448 * 2^126 / bf16_max = 112.4 (weights with amax below ~24). 128 leaves a margin.
_ASM_MIN_GLOBAL_SCALE = 128.0
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
    fits = _ASM_MIN_GLOBAL_SCALE < v < float("inf")
    setattr(weight_global_scale, _FITS_ATTR, (weight_global_scale._version, fits))
    return fits


def _sm_count(device: torch.device) -> int:
    return triton_gate.sm_count(device, 4)


def _split_for(tiles: int, k_blocks: int, sms: int) -> int:
    """Split the reduction until about two programs per SM exist, keeping >= 2 K blocks per program."""
    want = -(-2 * sms // tiles)
    return max(1, min(want, k_blocks // 2))


def pick_config(m: int, n_out: int, k_red: int, sms: int) -> TileConfig:
    """Tile for an [m, k_red] x [k_red, n_out] product (forward: n_out=N, k_red=K; backward: K, N).

    Small M is weight-bandwidth bound: the 16-row tensor-core tile, 64 output columns and split-K so
    that the whole chip streams weights. Large M is compute bound: 128 x 128 tiles, no split.
    """
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn, bk = 64, 128  # 128 divides every Qwen2.5 K, so the K masks go (16-byte loads)
        tiles = -(-n_out // bn) * -(-m // bm)
        # M <= 16: Triton's own cp.async pipeline (prefetch off) measured 5-15% faster on H200
        return TileConfig(bm, bn, bk, _split_for(tiles, -(-k_red // bk), sms), warps=4, stages=3, prefetch=m > 16)
    return TileConfig(128, 128, 64, 1, warps=8, stages=3)


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check(x: torch.Tensor, packed: torch.Tensor, k: int, fmt: str) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fmt} Triton kernels take bf16/fp16 inputs, got {x.dtype}")
    if packed.dtype != torch.uint8 or packed.shape[1] * 2 != k:
        raise ValueError(f"{fmt}: packed weight must be uint8 [N, {k // 2}], got {packed.dtype} {tuple(packed.shape)}")


def _u8(scale: torch.Tensor) -> torch.Tensor:
    s = scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)  # E4M3 bits: a free view
    return s if s.stride(-1) == 1 else s.contiguous()


def _run_linear(x, packed, scale, gs, bias, group, mx, fmt, config, fits=False):
    k = x.shape[-1]
    _check(x, packed, k, fmt)
    x2 = _as_2d(x)
    n = packed.shape[0]
    cfg = config or pick_config(x2.shape[0], n, k, _sm_count(x.device))
    b = None if bias is None else bias.to(x.dtype).contiguous()
    y = fp4_linear(x2, packed.contiguous(), _u8(scale), gs, b, group, mx, cfg, fits)
    return y.reshape(*x.shape[:-1], n)


def _run_grad_input(g, packed, scale, gs, group, mx, fmt, config, fits=False):
    k = packed.shape[1] * 2
    if g.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fmt} Triton kernels take bf16/fp16 gradients, got {g.dtype}")
    g2 = _as_2d(g)
    cfg = config or pick_config(g2.shape[0], k, packed.shape[0], _sm_count(g.device))
    y = fp4_grad_input(g2, packed.contiguous(), _u8(scale), gs, group, mx, cfg, fits)
    return y.reshape(*g.shape[:-1], k)


def _gs(weight_global_scale: torch.Tensor) -> torch.Tensor:
    return weight_global_scale.reshape(1).float().contiguous()


def nvfp4_linear_triton(x, weight_packed, weight_scale, weight_global_scale, bias=None, config=None):
    """x [..., K] bf16/fp16 -> x @ W^T + bias [..., N]; packed uint8 [N, K/2], scale e4m3 [N, K/16], gs fp32 [1]."""
    return _run_linear(x, weight_packed, weight_scale, _gs(weight_global_scale), bias, 16, False, "nvfp4", config,
                       x.is_cuda and step_fits_bf16(weight_global_scale))


def nvfp4_linear_gemv(x, weight_packed, weight_scale, weight_global_scale, bias=None, config=None):
    """Decode sizes (x viewed as [M, K] with M <= 16): the CUDA-core kernel of `triton_fp4_gemv`.
    Same arguments and result as `nvfp4_linear_triton`."""
    k = x.shape[-1]
    _check(x, weight_packed, k, "nvfp4")
    x2 = _as_2d(x)
    n = weight_packed.shape[0]
    b = None if bias is None else bias.to(x.dtype).contiguous()
    y = fp4_gemv(x2, weight_packed, _u8(weight_scale), _gs(weight_global_scale), b, config or GemvConfig(),
                 _sm_count(x.device))
    return y.reshape(*x.shape[:-1], n)


_GLUON: list = []  # [module or None]: the Gluon kernel module, imported on first use
# Widest LoRA rank sum the Gluon kernel's epilogue takes (its B tile [BN, R] lives in registers); wider
# (e.g. a fused q/k/v group at r >= 64) adds the term in one addmm after the kernel instead
LORA_IN_KERNEL_MAX_R = 128
_WGMMA_OK = [True]  # False once the wgmma variant failed to compile here (then the mma.sync form serves)


def gluon_module():
    """`gluon_nvfp4`, or None when this Triton has no usable Gluon (import or API errors)."""
    if not _GLUON:
        try:
            from . import gluon_nvfp4
        except (ImportError, AttributeError):  # no triton.experimental.gluon, or a different API
            gluon_nvfp4 = None
        _GLUON.append(gluon_nvfp4)
    return _GLUON[0]


def nvfp4_linear_swap(x, weight_packed, weight_scale, weight_global_scale, bias=None, config=None, split=None,
                      lora=None, wgmma=None):
    """Decode sizes through the Gluon swap-AB kernel (`gluon_nvfp4`), or None when it does not apply (not
    bf16, K % 128 != 0, a global scale too small for the bf16 step, no Gluon). Same result as
    `nvfp4_linear_triton` otherwise; lora = (h [..., R], scaling*B [N, R]) also adds h @ (scaling*B)^T.
    wgmma: None picks the Hopper wgmma variant on sm_90 where `triton_gate.wgmma_wins` says it is faster; True /
    False force it (tests, benchmarks)."""
    gk = gluon_module()
    if gk is None or not gk.supported(x, weight_packed, step_fits_bf16(weight_global_scale)):
        return None
    if lora is not None and lora[0].shape[-1] > LORA_IN_KERNEL_MAX_R:
        from .nvfp4_matmul import add_lora

        y = nvfp4_linear_swap(x, weight_packed, weight_scale, weight_global_scale, bias, config, split, wgmma=wgmma)
        return None if y is None else add_lora(y, lora)
    x2 = _as_2d(x)
    scale = _u8(weight_scale)
    if scale.stride(0) % 4:
        return None
    if torch.cuda.get_device_capability(x.device) < (8, 0):  # mma.sync m16n8k16 bf16 and cp.async need sm_80
        return None
    n = weight_packed.shape[0]
    b = None if bias is None else bias.to(x.dtype).contiguous()
    auto = wgmma is None
    if auto:
        wgmma = _WGMMA_OK[0] and triton_gate.wgmma_wins(x2.shape[0], n, x2.shape[1]) and \
            torch.cuda.get_device_capability(x.device) == (9, 0)
        if x2.shape[0] > triton_gate.SWAP_MAX_M and not wgmma:
            return None  # above 64 rows only the wgmma variant (sm_90) beats dequantize + cuBLAS
    lo = None if lora is None else (_as_2d(lora[0]), lora[1].contiguous())
    try:
        y = gk.nvfp4_linear_swap(x2, weight_packed.contiguous(), scale, _gs(weight_global_scale), b,
                                 _sm_count(x.device), config, split, lo, wgmma=wgmma)
    except (ValueError, TypeError):  # bad arguments (e.g. LoRA operand shapes): the caller's error
        raise
    except Exception as e:  # a GPU or Triton build this kernel does not compile for (shared memory, API)
        if config is not None or torch.cuda.is_current_stream_capturing() or (wgmma and not auto):
            raise  # an explicit choice (tests, benchmarks) must fail loudly, not fall back
        what = "wgmma variant of the Gluon NVFP4 decode kernel" if wgmma else "Gluon NVFP4 decode kernel"
        warnings.warn(f"{what} unavailable here ({type(e).__name__}: {str(e)[:200]}); using "
                      f"{'its mma.sync form' if wgmma else 'the Triton kernels'}", RuntimeWarning, stacklevel=2)
        if wgmma:
            _WGMMA_OK[0] = False
            return nvfp4_linear_swap(x, weight_packed, weight_scale, weight_global_scale, bias, config, split, lora)
        _GLUON[0] = None
        return None
    return y.reshape(*x.shape[:-1], n)


def nvfp4_grad_input_triton(grad_out, weight_packed, weight_scale, weight_global_scale, config=None):
    """grad_out [..., N] bf16/fp16 -> grad_out @ W [..., K]."""
    return _run_grad_input(grad_out, weight_packed, weight_scale, _gs(weight_global_scale), 16, False, "nvfp4",
                           config, grad_out.is_cuda and step_fits_bf16(weight_global_scale))


def mxfp4_linear_triton(x, weight_packed, weight_scale, bias=None, config=None):
    """x [..., K] -> x @ W^T + bias [..., N]; packed uint8 [N, K/2], scale uint8 E8M0 exponents [N, K/32]."""
    return _run_linear(x, weight_packed, weight_scale, None, bias, 32, True, "mxfp4", config)


def mxfp4_grad_input_triton(grad_out, weight_packed, weight_scale, config=None):
    """grad_out [..., N] -> grad_out @ W [..., K] for an MXFP4 weight."""
    return _run_grad_input(grad_out, weight_packed, weight_scale, None, 32, True, "mxfp4", config)


def nvfp4_dequantize_triton(weight_packed, weight_scale, weight_global_scale, dtype=torch.bfloat16):
    """W [N, K] in dtype, decoded on the device in one pass (for the dequantize + cuBLAS fallback)."""
    return fp4_dequantize(weight_packed.contiguous(), _u8(weight_scale), _gs(weight_global_scale), 16, False, dtype,
                          weight_packed.is_cuda and step_fits_bf16(weight_global_scale))


def mxfp4_dequantize_triton(weight_packed, weight_scale, dtype=torch.bfloat16):
    """W [N, K] in dtype for an MXFP4 weight, decoded on the device in one pass."""
    return fp4_dequantize(weight_packed.contiguous(), _u8(weight_scale), None, 32, True, dtype)
