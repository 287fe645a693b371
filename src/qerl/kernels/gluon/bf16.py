"""Gluon kernel: bf16 weight x bf16 activations at decode sizes ("swap AB" on mma.sync), for the 16-bit base.

The bf16 baseline (`quantize_model(fmt="bf16")`, the engine's bf16 variants) decoded through cuBLAS, whose
GEMV-like kernels at 1-16 rows stream the weights at 2.2-4.2 TB/s on an H200 (the large ones near the copy
bandwidth) but split K into a second reduce launch on most shapes (140 `splitKreduce_kernel` launches per 7B
step) and cannot take part in programmatic dependent launch (`pdl`), so each of their ~8 launches per layer
costs its full launch and ramp latency. This kernel is the NVFP4 decode kernel (`nvfp4`) without the decode:
  - out^T = W @ x^T: a [BN, BK] weight tile (16-byte cp.async into an NS-stage shared pipeline) is the A
    operand of mma.sync m16n8k16, the x tile [BM, BK] the B operand (cp.async in the same stage);
  - with PDL the first NS - 1 weight stages are in flight before the wait for the previous kernel;
  - split-K meets in the same launch (`common._store_out`: the last program of a tile sums the fp32
    partials in a fixed order), and a LoRA term h @ lb^T rides as one more MMA in the epilogue
    (`nvfp4._lora_tile`), so a bf16+LoRA linear is one launch instead of GEMM + reduce + addmm.
Rows of W past N and of x past M are zero-filled (no memory access). Requirements (checked by `supported`):
bf16 x and W on CUDA (sm_80+), K % 8 == 0 (16-byte rows), unit column strides. GPU-tested only: Gluon does
not run under the Triton interpreter.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import pdl
from ..route import GLUON_BF16, tile_config
from .common import _async_load, _barrier, _commit, _lora_tile, _store_out, _wait, launch_buffers, lora_operands


@gluon.jit
def _issue_rows(dst, ptr, rows_total, stride, row0, k0, K, valid, R: gl.constexpr, BK: gl.constexpr,
                NW: gl.constexpr):
    """cp.async of the bf16 tile [row0 : row0 + R, k0 : k0 + BK] into dst; rows >= rows_total, columns >= K
    and valid (scalar) False are zero-filled without a memory access."""
    TK: gl.constexpr = BK // 8 if BK // 8 <= 32 else 32
    CP: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [NW, 1], [1, 0])
    rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, CP))
    cols = k0 + gl.arange(0, BK, layout=gl.SliceLayout(0, CP))
    # stride and K are multiples of 8 (the launcher's checks): 16-byte copies, masked per 16 bytes
    p = ptr + gl.expand_dims(gl.multiple_of(rows * stride, 8), 1) + gl.expand_dims(cols, 0)
    m = gl.expand_dims(rows < rows_total, 1) & gl.expand_dims(cols < (K // 8) * 8, 0) & valid
    _async_load(dst, p, mask=m)


@gluon.jit
def bf16_swap_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_om, ws_ptr, cnt_ptr,
                     tiles_per_split, h_ptr, lb_ptr, stride_hm, R,
                     BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr, PARTIAL: gl.constexpr,
                     NW: gl.constexpr, HAS_BIAS: gl.constexpr, RP: gl.constexpr, PDL: gl.constexpr = False):
    """Grid (cdiv(N, BN), cdiv(M, BM), S); out bf16 [M, N] (row stride stride_om) = x [M, K] @ W [N, K]^T
    (+ bias [N] when HAS_BIAS; + h [M, R] @ lb [N, R]^T when RP > 0, R <= RP). Program (., ., s) covers the
    K tiles [s T, min(cdiv(K, BK), (s + 1) T)), T = tiles_per_split; PARTIAL (S > 1): the splits meet in
    `_store_out` (fp32 workspace ws [S, M, N], arrival counters cnt [grid_n * grid_m] int32, zero on entry
    and left zero). PDL: launched early (`pdl`); only weight stages are issued before the wait."""
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    SL: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    ws_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, BK], SL)
    xs_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BK], SL)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    t_lo = pid_k * tiles_per_split
    n = gl.minimum((K + BK - 1) // BK - t_lo, tiles_per_split)
    k_lo = t_lo * BK
    # stage s = weight tile s + x tile s; the weight tiles of the first NS - 1 stages are issued before the PDL
    # wait and join the commit group of x tile 0 (groups complete in order: group s done => stage s complete)
    for s in gl.static_range(NS - 1):
        _issue_rows(ws_s.index(s), w_ptr, N, stride_w, pid_n * BN, k_lo + s * BK, K, s < n, BN, BK, NW)
    if PDL:  # only static weights were read so far; x, LoRA h and every store come after the wait
        gdc_wait()
        gdc_launch_dependents()
    for s in gl.static_range(NS - 1):
        _issue_rows(xs_s.index(s), x_ptr, M, stride_xm, pid_m * BM, k_lo + s * BK, K, s < n, BM, BK, NW)
        _commit()
    for i in range(n):
        _wait(NS - 2)
        _barrier()  # stage i visible to every thread; stage (i - 1) % NS free (its MMA operands are in registers)
        j = i + NS - 1
        _issue_rows(ws_s.index(j % NS), w_ptr, N, stride_w, pid_n * BN, k_lo + j * BK, K, j < n, BN, BK, NW)
        _issue_rows(xs_s.index(j % NS), x_ptr, M, stride_xm, pid_m * BM, k_lo + j * BK, K, j < n, BM, BK, NW)
        _commit()
        a = ws_s.index(i % NS).load(A)
        b = xs_s.index(i % NS).permute((1, 0)).load(B)
        acc = mma_v2(a, b, acc)
    _wait(0)
    if RP > 0:
        acc = _lora_tile(acc, h_ptr, lb_ptr, stride_hm, R, M, N, pid_n, pid_m, pid_k == 0, BN, BM, RP, NW)
    _store_out(acc, mma, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k, BN, BM, PARTIAL,
               HAS_BIAS, NW)


# (BN, BM, BK, NS): weight rows per program (64 = 4 warps x 16), activation rows (the MMA's n: 8-64), columns
# per pipeline step, stages
Bf16Config = tuple[int, int, int, int]


def pick_config(m: int, n: int, k: int) -> tuple[Bf16Config, float]:
    """(tile, programs per SM) for [m, k] x [n, k]^T: the `gluon_bf16` table (kernels/tuning/default.json,
    `route.tile_config`). BM the next of 8, 16, 32, 64 rows, 3 stages, 128 columns per step, ~2 programs per SM
    for weights of >= 32M elements and 3 otherwise (the most frequent best tile of an H200 sweep over the
    Qwen2.5-7B shapes and the lm_head at M = 1 / 8 / 16; its effect in the engine: `qerl bench rollout`,
    docs/benchmarks.md "Rollout engine")."""
    t = tile_config(GLUON_BF16, m, n, k)
    return (t["BN"], t["BM"], t["BK"], t["NS"]), t["programs_per_sm"]


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this kernel takes x [M, K] @ w [N, K]^T: bf16 CUDA tensors of sm_80+, K % 8 == 0, w with unit
    column stride and 16-byte aligned rows, and w's element offsets within int32 (the kernel's index type)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and w.dim() == 2
            and x.shape[-1] == w.shape[1] and w.shape[1] % 8 == 0 and w.stride(1) == 1 and w.stride(0) % 8 == 0
            and w.shape[0] * w.stride(0) < 2**31 and w.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def bf16_linear_swap(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, sms: int,
                     config: Bf16Config | None = None, split: int | None = None,
                     lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] bf16 -> x @ w^T (+ bias) (+ h @ lb^T), [M, N] bf16. w bf16 [N, K] (unit column stride), bias
    bf16 [N] or None; lora: (h [M, R] bf16 with unit column stride, lb [N, R] bf16 contiguous), the LoRA delta
    with lb = scaling * B. config (BN, BM, BK, NS): None for `pick_config`'s; split: number of K splits (None:
    about the pick's programs per SM)."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    cfg, waves = (config, 3.0) if config is not None else pick_config(m, n, k)
    bn, bm, bk, ns = cfg
    tiles = triton.cdiv(k, bk)
    grid_nm = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    s = split if split is not None else max(1, min(tiles, -(-int(waves * sms) // grid_nm)))
    per = triton.cdiv(tiles, max(1, min(s, tiles)))
    s = triton.cdiv(tiles, per)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), s)
    out, ws, cnt = launch_buffers(x.device, m, n, s, grid[0] * grid[1])
    h, lb, stride_hm, r, rp = lora_operands(lora, m, n, out)
    bf16_swap_kernel[grid](x, w, bias if bias is not None else out, out, m, n, k, x.stride(0), w.stride(0),
                           out.stride(0), ws, cnt, per, h, lb, stride_hm, r,
                           BN=bn, BM=bm, BK=bk, NS=ns, PARTIAL=s > 1, NW=4, HAS_BIAS=bias is not None, RP=rp,
                           num_warps=4, **pdl.launch_options(x))
    return out
