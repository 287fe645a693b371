"""One-launch skinny GEMM h = x @ A^T for the LoRA "A" products of a decode step (see `lora_a` for why).

This module imports Triton: import it lazily (`lora_a.lora_a` does).

Layout of one launch, grid (cdiv(R, BR), splits, cdiv(M, BM)):
  program (r, s, m) computes the fp32 partial x[m-tile, Ks] @ A[r-tile, Ks]^T over its slice Ks of K
  (BM >= 16 rows through tl.dot, masked; one M tile up to BLOCK_M_MAX rows), and
    splits == 1: rounds it once and writes h;
    splits > 1:  stores it to the workspace, then takes a ticket from its (r, m) tile's arrival counter.
                 The program that draws the last ticket (old value == splits - 1) sums the tile's `splits`
                 partials in a fixed order, rounds once, writes h and sets the counter back to 0.
Memory ordering of the counter protocol (PTX memory model): every thread's partial stores -> CTA barrier
-> the counter atomic, acq_rel at GPU scope (issued by one thread per program) -> [last program] the
atomic's result reaches all its threads through shared memory and a barrier -> the partial loads. The
barrier + release publish the whole CTA's stores (cumulativity); the acquire + barrier order all later
loads of the last program after them; those loads also bypass L1 (`.cg`), so no line an SM cached earlier
is read. (Checked in the sm_90 PTX: st.global partials; bar.sync; @tid0 atom.global.gpu.acq_rel.add;
st.shared + bar.sync + ld.shared of the ticket; ld.global.cg of the partials.)

Split choice (`config`): about PROGRAMS_PER_SM programs per SM, each streaming at least MIN_K_PER_SPLIT
columns of K, and few enough splits that the last program of a tile reads all partials in at most
RED_ROUNDS dependent rounds of RED_ELEMS elements: that tail is serial latency after the main loop. The
constants come from a sweep on an H200 (`lora_a_sweep.py`; docs/benchmarks.md,
"Investigation scripts no longer in the tree"): the default is within 0.2 us of the best swept (splits, BR) at
Qwen2.5-7B decode shapes; `splits` / `block_r` / `block_m` override them.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import pdl
from ..route import sm_count
from ..workspace import alloc, has_persistent, persistent
from .fp4_codes import round_to

# Defaults set by the sweep of `lora_a_sweep.py` (docs/benchmarks.md's script list; Qwen2.5-7B r16 decode, M 1/8/64)
MIN_K_PER_SPLIT = 256  # a program streams at least this many K columns (fewer: the split overhead dominates)
PROGRAMS_PER_SM = 2  # target programs per SM in one launch (latency-bound: enough loads in flight)
BLOCK_M_MAX = 32  # rows per program; M = 33..64 gets 2 M tiles (halves the x bytes per program and the tail)
CPU_SMS = 2  # stand-in "SM count" for the interpreter (any small number; only shapes the test cases)
RED_ELEMS = 8192  # partial elements the last program loads at once (64 fp32 registers a thread at 4 warps)
RED_ROUNDS = 1  # at most this many such dependent loads in the tail
PRELOAD_MAX_K = 512  # with PDL, a program's whole K slice (A [BR, <= this]) is loaded before the wait

# Split launches keep (workspace fp32 [n_r, splits, M, BR], counters int32 [n_r, n_m]) per (device, stream, M,
# R, splits, BR, BM) in `workspace.persistent`, for the life of the process: captured CUDA graphs hold their addresses.


@triton.jit
def _dot_acc(xt, at, acc, INTERP: tl.constexpr):
    """acc + xt [BM, k] @ at [BR, k]^T in fp32."""
    if INTERP:
        # the interpreter's bf16 tl.dot is wrong (Triton 3.9); the same 16-bit values as float32 give the
        # same products
        return tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), acc)
    return tl.dot(xt, tl.trans(at), acc)


@triton.jit
def _lora_a_kernel(x_ptr, a_ptr, h_ptr, ws_ptr, cnt_ptr, M, R, K, stride_xm, stride_am, stride_hm, K_PER_SPLIT,
                   SPLITS, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   SPLIT: tl.constexpr, RED_M: tl.constexpr, SB: tl.constexpr, INTERP: tl.constexpr,
                   KP: tl.constexpr = 0, PDL: tl.constexpr = False):
    """h[M, R] = x[M, K] @ a[R, K]^T. See the module docstring for the split protocol.

    x: 16-bit, row stride stride_xm, unit column stride; a: same dtype, row stride stride_am, unit column
    stride; h: same dtype, row stride stride_hm. ws: fp32 [cdiv(R, BR), SPLITS, M, BR] contiguous; cnt:
    int32 [cdiv(R, BR), cdiv(M, BM)], all 0 on entry and on exit. K_PER_SPLIT is a multiple of BK; EVEN_K:
    K % BK == 0 (no column masks, so loads stay 16-byte vectors). RED_M = min(BM, next_pow2(M)) rows and
    SB splits are reduced at once by the last program. KP > 0 (a power of two >= K_PER_SPLIT): the slice is
    one [BR, KP] x [BM, KP] product instead of the BK loop, with A loaded before the PDL wait.
    """
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_r = pid_r * BR + tl.arange(0, BR)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    r_mask = offs_r < R
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    a_rows = a_ptr + offs_r[:, None] * stride_am

    k_lo = pid_s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)  # a split past K (forced splits) runs no iteration: zero partial
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    if KP > 0:
        # the whole slice at once: A [BR, KP] is static for a decode step, so with PDL it is loaded before
        # the wait for x (the previous kernel's output) and its latency overlaps that kernel's tail
        pcols = k_lo + tl.arange(0, KP)
        pmask = pcols < k_hi
        a_all = tl.load(a_rows + pcols[None, :], mask=r_mask[:, None] & pmask[None, :], other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        x_all = tl.load(x_rows + pcols[None, :], mask=m_mask[:, None] & pmask[None, :], other=0.0)
        acc = _dot_acc(x_all, a_all, acc, INTERP)
    else:
        if PDL:  # launched early (`pdl`): every load and store here waits for the previous kernel
            gdc_wait()
            gdc_launch_dependents()
        for k in range(k_lo, k_hi, BK):
            cols = k + offs_k
            if EVEN_K:
                xt = tl.load(x_rows + cols[None, :], mask=m_mask[:, None], other=0.0)
                at = tl.load(a_rows + cols[None, :], mask=r_mask[:, None], other=0.0)
            else:
                # k_lo is a multiple of BK, so only the last block of K itself is ragged: mask on K, not k_hi
                k_mask = cols < K
                xt = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                at = tl.load(a_rows + cols[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc = _dot_acc(xt, at, acc, INTERP)

    dtype = h_ptr.dtype.element_ty
    if not SPLIT:
        h_ptrs = h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :]
        tl.store(h_ptrs, round_to(acc, dtype, INTERP), mask=m_mask[:, None] & r_mask[None, :])
    else:
        # this R tile's partials: [SPLITS, M, BR], M rows only (padding rows would multiply the tail read
        # for small M); this program's block is rows offs_m of split pid_s
        tile = ws_ptr + pid_r.to(tl.int64) * SPLITS * M * BR
        cols_r = tl.arange(0, BR)
        tl.store(tile + (pid_s * M + offs_m[:, None]) * BR + cols_r[None, :], acc, mask=m_mask[:, None])
        # every thread's stores happen before the (single-thread) release below
        tl.debug_barrier()
        cnt = cnt_ptr + pid_r * tl.num_programs(2) + pid_m
        old = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if old == SPLITS - 1:
            # last arrival: all SPLITS partials are published (their releases precede our acquire)
            red_s = tl.arange(0, SB)
            red_m = pid_m * BM + tl.arange(0, RED_M)
            red_rows = (red_m < M)[None, :, None]
            total = tl.zeros((RED_M, BR), dtype=tl.float32)
            for s0 in range(0, SPLITS, SB):
                # SB partials at once (independent loads in flight), chunks added in order s0 = 0, SB, ...;
                # tl.sum within a chunk is a fixed tree: the result is the same on every call
                s_idx = s0 + red_s
                ptrs = tile + ((s_idx[:, None, None] * M + red_m[None, :, None]) * BR + cols_r[None, None, :])
                part = tl.load(ptrs, mask=(s_idx < SPLITS)[:, None, None] & red_rows, other=0.0,
                               cache_modifier=".cg")
                total += tl.sum(part, axis=0)
            out_r = pid_r * BR + cols_r
            h_ptrs = h_ptr + red_m[:, None] * stride_hm + out_r[None, :]
            tl.store(h_ptrs, round_to(total, dtype, INTERP), mask=(red_m < M)[:, None] & (out_r < R)[None, :])
            # every program of this tile has arrived: reset for the next launch (stream order makes the
            # store visible to it; a CUDA graph replay relies on this)
            tl.store(cnt, 0)


def _sm_count(device: torch.device) -> int:
    return sm_count(device, CPU_SMS)


def config(M: int, R: int, K: int, device: torch.device, splits: int | None = None, block_r: int | None = None,
           block_m: int | None = None) -> dict:
    """Tile sizes and split count for an [M, K] x [R, K]^T product (see the module docstring).

    The automatic split count is recomputed from the rounded K_PER_SPLIT (a multiple of BK), so no program
    is empty. A forced `splits` is kept as given (programs past K add zero partials).
    """
    BM = block_m or min(max(16, triton.next_power_of_2(M)), BLOCK_M_MAX)
    BR = block_r or 16
    BK = 128 if BM <= 32 else 64  # x tile [BM, BK] + A tile [BR, BK] per pipeline stage
    n_r, n_m = triton.cdiv(R, BR), triton.cdiv(M, BM)
    RED_M = min(BM, triton.next_power_of_2(M))
    if splits is None:
        target = max(1, PROGRAMS_PER_SM * _sm_count(device) // (n_r * n_m))
        tail = max(1, RED_ROUNDS * RED_ELEMS // (RED_M * BR))
        splits = max(1, min(target, K // MIN_K_PER_SPLIT, tail))
        k_per = triton.cdiv(triton.cdiv(K, splits), BK) * BK
        splits = max(1, triton.cdiv(K, k_per))
    else:
        splits = max(1, int(splits))
        k_per = triton.cdiv(triton.cdiv(K, splits), BK) * BK
    k_per = max(k_per, BK)
    SB = min(triton.next_power_of_2(splits), max(1, RED_ELEMS // (RED_M * BR)))
    return dict(BM=BM, BR=BR, BK=BK, n_r=n_r, n_m=n_m, splits=splits, k_per=k_per, RED_M=RED_M, SB=SB)


def buffers(device: torch.device, M: int, R: int, splits: int, BR: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached (workspace, counters) of one launch shape on the current stream; allocated on first use
    (counters zeroed). Calls with different K but the same key share them (one stream runs them in order:
    each launch leaves the counters at 0 and rewrites the partials before it reads them)."""
    return persistent("lora_a", device, (M, R, splits, BR, BM), lambda: (
        alloc((triton.cdiv(R, BR), splits, M, BR), device, torch.float32),
        torch.zeros(triton.cdiv(R, BR), triton.cdiv(M, BM), dtype=torch.int32, device=device)))


def has_buffers(device: torch.device, M: int, R: int, K: int, splits: int | None = None,
                block_r: int | None = None, block_m: int | None = None) -> bool:
    """True when a call with these arguments allocates nothing besides its output."""
    cfg = config(M, R, K, device, splits, block_r, block_m)
    return cfg["splits"] == 1 or has_persistent("lora_a", device, (M, R, cfg["splits"], cfg["BR"], cfg["BM"]))


def lora_a_triton(x: torch.Tensor, a: torch.Tensor, splits: int | None = None, block_r: int | None = None,
                  block_m: int | None = None, preload: bool | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride, any row stride), a [R, K] contiguous, both bf16 or fp16 -> h [M, R].

    fp32 accumulation, one rounding to x's dtype. The workspace and counters are kept per stream. `splits`, `block_r`
    (16 or 32 ...) and `block_m` (16, 32, 64) override the automatic choice (tests, tuning). preload: each
    program's K slice as one product, A loaded before the PDL wait (None: when launched with PDL and the
    slice is at most PRELOAD_MAX_K columns).
    """
    M, K = x.shape
    R = a.shape[0]
    assert a.shape[1] == K and a.dtype == x.dtype and x.stride(1) == 1 and a.is_contiguous()
    cfg = config(M, R, K, x.device, splits, block_r, block_m)
    h = alloc((M, R), x.device, x.dtype)
    split = cfg["splits"] > 1
    if split:
        ws, cnt = buffers(x.device, M, R, cfg["splits"], cfg["BR"], cfg["BM"])
    else:
        ws = cnt = h  # unused by the kernel
    launch = pdl.launch_options(x)
    if preload is None:
        preload = launch["PDL"] and cfg["k_per"] <= PRELOAD_MAX_K
    _lora_a_kernel[(cfg["n_r"], cfg["splits"], cfg["n_m"])](
        x, a, h, ws, cnt, M, R, K, x.stride(0), a.stride(0), h.stride(0), cfg["k_per"], cfg["splits"],
        BM=cfg["BM"], BR=cfg["BR"], BK=cfg["BK"], EVEN_K=K % cfg["BK"] == 0, SPLIT=split, RED_M=cfg["RED_M"],
        SB=cfg["SB"], INTERP=x.device.type != "cuda", KP=triton.next_power_of_2(cfg["k_per"]) if preload else 0,
        num_warps=4, num_stages=3, **launch)
    return h
