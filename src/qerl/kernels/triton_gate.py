"""When to take the Triton path, decided without importing Triton (CPU users may not have it).

The fused kernels run when the activation is a CUDA bf16/fp16 tensor and Triton can be imported.
QERL_DISABLE_TRITON=1 forces the plain-torch reference path (debugging, benchmarks).
Forward x @ W^T, by rows M (H200 measurements in docs/benchmarks.md):
  - M <= SWAP_MAX_M (64): the Gluon swap-AB kernel (`gluon_nvfp4`, NVFP4 only) when it applies (bf16, K %
    128 == 0, global scale > 128); it beats the other paths at every Qwen2.5 shape there; from WGMMA_MIN_M
    rows on sm_90 its wgmma variant (`gluon_nvfp4_wgmma`; `wgmma_wins`, `permute_x_wins`), and from
    WGMMA_SMALL_M rows for the largest weights;
  - on sm_90 only, up to WGMMA_MAX_M (128) rows, and up to WGMMA_MAX_M_BIG (256) for weights of >=
    PERMUTE_X_MIN_WEIGHT elements: the wgmma variant with 128-row activation tiles (`wide_wgmma_wins`);
  - otherwise M <= GEMV_ROUTE_MAX_M (1): the CUDA-core kernel (`triton_fp4_gemv`);
  - then `fused_wins` picks between the fused tl.dot kernel and "dequantize W on the device in one Triton
    pass into a temporary (the caching allocator reuses the block), then cuBLAS": fused up to M = 16, and up
    to M = 64 for weights of >= 32M elements; above that (prefill, the loss pass, the training backward)
    dequantize + cuBLAS. The input gradient uses `fused_wins` alone.
"""

import importlib.util
import os

import torch

SWAP_MAX_M = 64  # forward up to here: the Gluon swap-AB kernel (gluon_nvfp4) when it applies (H200: beats
# the fused kernel and dequantize + cuBLAS at every Qwen2.5 shape for M <= 64, cuBLAS bf16 up to M = 16-32)
# From WGMMA_MIN_M to SWAP_MAX_M rows, on sm_90: the wgmma variant; with x rewritten once in operand order
# (`permute_x_wins`) for weights of PERMUTE_X_MIN_WEIGHT elements and more. H200 (docs/benchmarks.md): that
# made it 1.01-1.51x faster than staging x through registers on weights of 67-283M elements at M = 16-64,
# 0.88-0.98x on 13-17M; with it, wgmma beats the mma.sync form on every measured shape at M = 16-64 (the
# staged form had lost on 7B gate_up at M = 16 and 32B/72B gate_up at M = 32). 5-8 rows: the wgmma form
# with x pre-permuted for weights of WGMMA_SMALL_M_MIN_WEIGHT elements and more, else mma.sync (H200,
# `benchmarks/experimental/wgmma_swap/x_permuted.py 1,4,8`: at M = 8 1.05x mma.sync on 7B gate_up, 1.13x on
# 72B down, 1.18x on 32B gate_up, 1.05x on 7B down (68M elements, below the bar) but 0.93-0.94x on 72B o
# (67M); at M = 1-4 no form wins everywhere).
# Above SWAP_MAX_M (sm_90 only; elsewhere dequantize + cuBLAS): the wgmma variant, 128 activation rows per
# tile, x pre-permuted, up to WGMMA_MAX_M rows for every weight and WGMMA_MAX_M_BIG rows for weights of
# PERMUTE_X_MIN_WEIGHT elements and more. H200, session 8 (`benchmarks/experimental/wgmma_swap/sweep_large_m.py`):
# at M = 128 1.02-2.28x dequantize + cuBLAS on the 7B shapes, at M = 256 1.30-1.42x on 7B gate_up / down but
# 0.86-0.94x on q/k/v and o, at M = 1024 0.71-0.84x everywhere.
WGMMA_MAX_M = 128
WGMMA_MAX_M_BIG = 256
WGMMA_MIN_M = 9
WGMMA_SMALL_M = 5
WGMMA_SMALL_M_MIN_WEIGHT = 100 * 2**20
PERMUTE_X_MIN_WEIGHT = 32 * 2**20
# bf16 weights (the 16-bit baseline) and the engine's bf16 lm_head up to here: the Gluon kernel `gluon_bf16`
# instead of cuBLAS. H200, 7B engine (`benchmarks/experimental/bf16_kernel_ab.py`, session 8): bf16+LoRA
# 5.15 -> 4.49 ms per step at batch 1, 5.44 -> 4.73 at 8, 5.70 -> 4.93 at 16, 5.96 -> 5.72 at 32 (routed up
# to 64 rows: 6.24 -> 7.37 at 64, where cuBLAS's tensor-core GEMMs win)
BF16_SWAP_MAX_M = 32
GEMV_ROUTE_MAX_M = 1  # route to the CUDA-core decode kernel up to here (it can take 16 rows; H200: wins only at M=1)
FUSED_MAX_M = 16  # always fused up to here
FUSED_MAX_M_BIG = 64  # ... and up to here when the weight has >= BIG_WEIGHT elements
BIG_WEIGHT = 32 * 1024 * 1024
_HAVE_TRITON: bool | None = None


def triton_available() -> bool:
    global _HAVE_TRITON
    if _HAVE_TRITON is None:
        _HAVE_TRITON = importlib.util.find_spec("triton") is not None
    return _HAVE_TRITON


def triton_enabled() -> bool:
    """Triton importable and not turned off (QERL_DISABLE_TRITON=1)."""
    return os.environ.get("QERL_DISABLE_TRITON", "0") != "1" and triton_available()


def use_triton(x: torch.Tensor) -> bool:
    """True when x should go through the Triton kernels."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and triton_enabled()


def swap_wins(m: int, n: int, k: int) -> bool:
    """Forward x @ W^T with m rows: try the Gluon swap-AB kernel first (it declines shapes it cannot take,
    and rows above SWAP_MAX_M where the wgmma variant cannot run)."""
    return 1 <= m <= SWAP_MAX_M or wide_wgmma_wins(m, n, k)


def wide_wgmma_wins(m: int, n: int, k: int) -> bool:
    """Rows above SWAP_MAX_M that the wgmma variant takes from dequantize + cuBLAS (sm_90 only)."""
    return SWAP_MAX_M < m <= (WGMMA_MAX_M_BIG if n * k >= PERMUTE_X_MIN_WEIGHT else WGMMA_MAX_M)


def wgmma_wins(m: int, n: int, k: int) -> bool:
    """Within the swap-AB range: the Hopper wgmma variant of the Gluon kernel (True) or its mma.sync form."""
    if WGMMA_SMALL_M <= m < WGMMA_MIN_M:
        return n * k >= WGMMA_SMALL_M_MIN_WEIGHT  # those weights also take the pre-permuted x (permute_x_wins)
    return WGMMA_MIN_M <= m <= SWAP_MAX_M or wide_wgmma_wins(m, n, k)


def permute_x_wins(n: int, k: int, m: int = 1) -> bool:
    """wgmma form: rewrite x in operand order first (one extra small launch) rather than stage it every step
    (always above SWAP_MAX_M rows: staging a 128-row x tile through registers every step costs more)."""
    return n * k >= PERMUTE_X_MIN_WEIGHT or m > SWAP_MAX_M


def bf16_swap_wins(m: int, n: int, k: int) -> bool:
    """Forward x @ W^T with a bf16 weight and m rows: the Gluon kernel (True) or cuBLAS."""
    return 1 <= m <= BF16_SWAP_MAX_M


def gemv_wins(m: int, n: int, k: int) -> bool:
    """Forward x @ W^T with m rows: the CUDA-core decode kernel (True) or the tensor-core paths."""
    return 1 <= m <= GEMV_ROUTE_MAX_M


def fused_wins(m: int, n: int, k: int) -> bool:
    """Fused kernel (True) or dequantize + cuBLAS (False) for an [m, .] x [N, K] product, either direction."""
    return m <= FUSED_MAX_M or (m <= FUSED_MAX_M_BIG and n * k >= BIG_WEIGHT)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device, cpu_stand_in: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached); `cpu_stand_in` for the Triton interpreter on the
    CPU, which has none (a small number that still exercises the kernels' splits)."""
    if device.type != "cuda":
        return cpu_stand_in
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def rows(x: torch.Tensor) -> int:
    """Number of rows M of x viewed as [M, features]."""
    return x.numel() // max(1, x.shape[-1])
