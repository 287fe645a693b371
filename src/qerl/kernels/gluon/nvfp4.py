"""Gluon kernel: NVFP4 weight x bf16 activations at decode sizes, W as the A operand of mma.sync ("swap AB").

out[M, N] = x[M, K] @ W[N, K]^T is computed as out^T = W @ x^T, so the weight rows fill the MMA's 16-row
side and the few activation rows its 8-column side. What makes it fast on Hopper (no FP4 tensor cores):
  - the decoded bf16 weights never touch shared memory: raw packed bytes and scale bytes go global ->
    shared by cp.async (an NS-stage pipeline) and are read straight into the A-operand register layout
    (`DotOperandLayout(0, mma v2, k_width=KW)`, 16 consecutive bytes per thread = two scale groups), then
    decoded in registers -- plain `triton.language` cannot express that layout (its dot-operand hoisting
    stops at the scale multiply, so the decoded tile round-trips through shared memory);
  - even/odd split: byte j of a row holds k = 2j (low nibble) and 2j+1 (high nibble); the low nibbles form
    A_lo [BN, BKH], the high ones A_hi, and out^T += A_lo @ x_lo^T + A_hi @ x_hi^T;
  - decode by inline PTX, two nibbles 16 bits apart per step: t = q & 0x000F000F, (t * 0x1040) &
    0x81C081C0 = s<<15 | mag<<6 in each half (the E2M1 value * 2^-126 as bf16, see triton.fp4_codes),
    one mul.rn.bf16x2 by step * 2^126: ~2.1 instructions per weight, ~3.4-3.9 per weight for the whole
    loop at M <= 16 (SASS). The pairing permutes k inside each 4-byte group (SIGMA = [0, 2, 1, 3]); x is
    permuted the same way when split into x_lo / x_hi, so the product is unchanged;
  - the per-group scale is held once per register run: its layout is derived from the A layout and the
    broadcast to [BN, BKH] is checked to move no data (`convert_layout(..., assert_trivial=True)`);
  - a LoRA term h @ (scaling B)^T can ride along as one more MMA in the epilogue (`lora=`), which saves the
    rollout engine one addmm launch per linear;
  - split-K without a second launch: the program that arrives last at its output tile (an arrival counter
    per tile, reset by that program) sums the fp32 partials in a fixed order, so the result is
    deterministic (at decode sizes a separate reduce launch costs about as much as a small layer's matmul).
Requirements (`route` sends only such calls here): bf16 x, K % 128 == 0, scale rows 4-byte aligned,
global_scale > 128 (step * 2^126 finite in bf16, as for the inline-PTX decode of the Triton kernels), sm_80+
(sm_90 for the wgmma form). One source for Triton 3.6 and newer (two API names differ, see `common`).
GPU-tested only: Gluon does not run under the Triton interpreter. The helpers shared with the wgmma form and
`bf16` live in `common`.

Entry: `nvfp4_linear_gluon` (the format's tensors as stored, any leading dims); `nvfp4_linear_swap` is its
launcher on prepared 2-D operands.
"""

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import pdl
from ..operands import add_lora, as_2d, global_scale_f32, scale_bytes, step_fits_bf16
from ..route import GLUON_MMA, GLUON_WGMMA, current_policy, permute_x, permute_x_rule, sm_count, tile_config
from ..workspace import alloc
from .common import (_barrier, _commit, _decode_stage, _issue_w, _load_x_split, _lora_tile, _store_out, _wait,
                           launch_buffers, lora_operands)


@gluon.jit
def _stage_x(xl_s, xh_s, x_ptr, M, stride_xm, pid_m, k0, BM: gl.constexpr, BKH: gl.constexpr, NW: gl.constexpr):
    """x[BM rows, k0 : k0 + 2 BKH] -> x_lo [BM, BKH], x_hi shared tiles, in the k order of the decode."""
    xlo, xhi = _load_x_split(x_ptr, M, stride_xm, pid_m, k0, BM, BKH, NW)
    xl_s.store(xlo)
    xh_s.store(xhi)


@gluon.jit
def _mma_tile(acc, wq_s, ws_s, xl_s, xh_s, c, BN: gl.constexpr, BKH: gl.constexpr, KW: gl.constexpr,
              NW: gl.constexpr, E4M3_CVT: gl.constexpr):
    """Bytes and scales from one pipeline stage (ld.shared straight into the A-operand layout), decode in
    registers, two mma.sync products against x_lo^T / x_hi^T."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    lo, hi = _decode_stage(wq_s, ws_s, c, A, gl.to_linear_layout(A, [BN, BKH]), BN, BKH, E4M3_CVT)
    xlo = xl_s.permute((1, 0)).load(B)
    xhi = xh_s.permute((1, 0)).load(B)
    acc = mma_v2(lo, xlo, acc)
    acc = mma_v2(hi, xhi, acc)
    return acc


@gluon.jit
def nvfp4_swap_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_s, stride_om,
                      ws_ptr, cnt_ptr, tiles_per_split, h_ptr, lb_ptr, stride_hm, R,
                      BN: gl.constexpr, BM: gl.constexpr, BKH: gl.constexpr, KW: gl.constexpr, NS: gl.constexpr,
                      PARTIAL: gl.constexpr, NW: gl.constexpr, SALIGN: gl.constexpr, HAS_BIAS: gl.constexpr,
                      RP: gl.constexpr, PDL: gl.constexpr = False, E4M3_CVT: gl.constexpr = True):
    """Grid (cdiv(N, BN), cdiv(M, BM), S); K % (2 BKH) == 0; out bf16 [M, N] (row stride stride_om) = x @ W^T
    (+ bias [N] when HAS_BIAS). Program (., ., s) covers tiles [s T, min(K / BK, (s + 1) T)) of BK = 2 BKH
    columns, T = tiles_per_split; PARTIAL (S > 1): the splits meet in `_store_out` (fp32 workspace ws
    [S, M, N], arrival counters cnt [grid_n * grid_m] int32, zero on entry and left zero). NS-stage
    cp.async pipeline for the raw weight/scale bytes; x is staged through registers (split into lo/hi and
    permuted) into a double-buffered shared tile, one tile ahead.
    RP > 0: also add the LoRA term h[M, R] @ lb[N, R]^T (h row stride stride_hm, lb contiguous, both bf16;
    R <= RP, RP a power of two >= 16) as one more MMA in the epilogue of split 0.
    PDL: launched early (`pdl`); the first weight stages are in flight before the wait for x.
    E4M3_CVT (sm_89+): the scale bytes convert two per instruction (`common._decode_stage`)."""
    BK: gl.constexpr = 2 * BKH
    G: gl.constexpr = BKH // 8
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    XS: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    WS: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    SS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    xls = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BKH], XS)  # x_lo, double buffered
    xhs = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BKH], XS)  # x_hi
    wqs = gl.allocate_shared_memory(gl.uint8, [NS, BN, BKH], WS)
    wss = gl.allocate_shared_memory(gl.uint8, [NS, BN, G], SS)
    c = 1.4757395258967641e20 / gl.load(gs_ptr)  # 2^67 / global_scale (2^134 would overflow fp32)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    t_lo = pid_k * tiles_per_split
    n = gl.minimum(K // BK - t_lo, tiles_per_split)
    k_lo = t_lo * BK
    for s in gl.static_range(NS - 1):
        _issue_w(wqs.index(s), wss.index(s), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k_lo + s * BK, s < n,
                 BN, BKH, NW, SALIGN)
        _commit()
    if PDL:  # only static weight bytes were read so far; x, LoRA h and every store come after the wait
        gdc_wait()
        gdc_launch_dependents()
    _stage_x(xls.index(0), xhs.index(0), x_ptr, M, stride_xm, pid_m, k_lo, BM, BKH, NW)
    for i in range(n):
        _wait(NS - 2)
        _barrier()  # stage i (all threads' copies) and x tile i visible; stage (i-1)%NS and x buffer (i+1)%2 free
        j = i + NS - 1
        _issue_w(wqs.index(j % NS), wss.index(j % NS), w_ptr, s_ptr, N, stride_w, stride_s, pid_n, k_lo + j * BK,
                 j < n, BN, BKH, NW, SALIGN)
        _commit()
        acc = _mma_tile(acc, wqs.index(i % NS), wss.index(i % NS), xls.index(i % 2), xhs.index(i % 2), c,
                        BN, BKH, KW, NW, E4M3_CVT)
        if i + 1 < n:
            _stage_x(xls.index((i + 1) % 2), xhs.index((i + 1) % 2), x_ptr, M, stride_xm, pid_m,
                     k_lo + (i + 1) * BK, BM, BKH, NW)
    _wait(0)
    if RP > 0:
        acc = _lora_tile(acc, h_ptr, lb_ptr, stride_hm, R, M, N, pid_n, pid_m, pid_k == 0, BN, BM, RP, NW)
    _store_out(acc, mma, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_m, pid_k, BN, BM, PARTIAL,
               HAS_BIAS, NW)


# (BN, BM, BKH, KW, NS): weight rows per program, activation rows (MMA n, >= 8), packed bytes per row per
# step (BK = 2 BKH columns), register run per thread, pipeline stages
SwapConfig = tuple[int, int, int, int, int]


def _swap_tile(t: dict, k: int) -> tuple[SwapConfig, float]:
    """A `route.tile_config` row as (tile, programs per SM); 64 packed bytes per step where K is not a multiple
    of the row's step."""
    cfg = (t["BN"], t["BM"], t["BKH"], t["KW"], t["NS"])
    if k % (2 * cfg[2]):
        cfg = (*cfg[:2], 64, *cfg[3:])
    return cfg, t["programs_per_sm"]


def pick_config(m: int, n: int, k: int) -> tuple[SwapConfig, float]:
    """(tile, programs per SM) for an [m, k] x [n, k]^T product (k % 128 == 0): the `gluon_mma` table
    (kernels/tuning/default.json, `route.tile_config`). Per row bucket the tile of `qerl bench kernels --swap`'s
    tile sweep (src/qerl/bench/kernels.py, `swap_candidates`) that was fastest most often over the
    Qwen2.5-7B/32B/72B shapes on an H200; programs per SM from the split sweep (docs/benchmarks.md,
    "Investigation scripts no longer in the tree": `split_sweep.py`)."""
    return _swap_tile(tile_config(GLUON_MMA, m, n, k), k)


def pick_config_wgmma(m: int, n: int, k: int) -> tuple[SwapConfig, float]:
    """(tile, programs per SM) for the wgmma kernel (`nvfp4_wgmma`, the rows `route.wgmma_rows` sends it): the
    `gluon_wgmma` table (kernels/tuning/sm90.json, `route.tile_config`, x pre-permuted by `route.permute_x_rule`).
    One 64-row wgmma tile per warpgroup, 3 stages; BM (the wgmma N) the next of 8, 16, 32, 64; up to 16 rows 128
    packed bytes per step and ~4 programs per SM, above that 64 bytes and ~3; with x pre-permuted 128 bytes per
    step at 17-32 rows for gate/up-like weights (N > 4 K) and ~2 programs per SM at 33-64 rows; above 64 rows 2
    stages and 128 activation rows per tile for big weights, `KernelPolicy.wide_m_tile` (64) for the others. Set
    from H200 tile sweeps over BN x (BKH, NS) x programs per SM (docs/benchmarks.md; split_sweep.py timed the
    split, small_weight_tiles.py every tile and split at a small model's shapes, "Small weights at rollout rows";
    both scripts: `NAME.py` in docs/benchmarks.md's script list)."""
    xp = permute_x_rule(current_policy(), m, n, k)
    return _swap_tile(tile_config(GLUON_WGMMA, m, n, k, x_permuted=xp), k)


def split_for(m: int, n: int, k: int, cfg: SwapConfig, sms: int, waves: float = 2.0,
              min_tiles_per_split: int = 1) -> tuple[int, int]:
    """(number of K splits, K tiles per split): about `waves` programs per SM, each split taking at least
    `min_tiles_per_split` K tiles (fewer splits where K is short), and none where the output tiles alone give every
    SM two programs (a split then only adds the partials' meeting: a 1.5B model's gate/up at 8 rows ran 10.4 us
    whole against 12.6 us in two splits; `benchmarks/fp4_gemv_bound.py --splits`)."""
    bn, bm, bkh = cfg[:3]
    tiles = k // (2 * bkh)
    grid_nm = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    if grid_nm >= 2 * sms:
        return 1, tiles
    s = max(1, min(tiles // max(1, min_tiles_per_split), math.ceil(waves * sms / grid_nm)))
    per = triton.cdiv(tiles, s)
    return triton.cdiv(tiles, per), per


def _scale_align(stride: int) -> int:
    a = 16
    while stride % a:
        a //= 2
    return a


def nvfp4_linear_swap(x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
                      bias: torch.Tensor | None, sms: int, config: SwapConfig | None = None,
                      split: int | None = None, lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                      wgmma: bool = False, x_permuted: bool | None = None) -> torch.Tensor:
    """x [M, K] bf16 (unit column stride) -> x @ W^T + bias, [M, N] bf16. packed uint8 [N, K/2] contiguous,
    scale_u8 uint8 [N, K/16] (E4M3 bits) contiguous, global_scale fp32 [1], bias bf16 [N] or None.
    config: (BN, BM, BKH, KW, NS), None for `pick_config`'s; split: number of K splits (None: the pick's
    programs per SM, 2 with an explicit config). lora: (h [M, R] bf16 with unit column stride, lb [N, R]
    bf16 contiguous), adds h @ lb^T (a LoRA delta: h = x @ A^T, lb = scaling * B) in the same launch.
    wgmma: the Hopper-only wgmma variant (`nvfp4_wgmma`; sm_90, BN a multiple of 64) instead of mma.sync;
    x_permuted (wgmma only; None: `route.permute_x` under the current policy): x is first rewritten in the
    operand order by one small launch, then copied into the pipeline by cp.async instead of staged through
    registers every step."""
    m, k = x.shape
    n = packed.shape[0]
    if x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    cfg, waves = (config, 2.0) if config is not None else (pick_config_wgmma if wgmma else pick_config)(m, n, k)
    bn, bm, bkh, kw, ns = cfg
    if k % (2 * bkh):
        raise ValueError(f"K={k} is not a multiple of the tile's {2 * bkh} columns")
    salign = _scale_align(scale_u8.stride(0))
    if salign < 4:
        raise ValueError(f"scale rows must be 4-byte aligned (K % 64 == 0), got row stride {scale_u8.stride(0)}")
    tiles = k // (2 * bkh)
    if split is None:
        # above 32 rows each split writes and re-reads an M x N fp32 partial: short K loops do not pay for it
        floor = current_policy().wide_m_min_k_tiles if wgmma and config is None and m > 32 else 1
        s, per = split_for(m, n, k, cfg, sms, waves, floor)
    else:
        per = triton.cdiv(tiles, max(1, min(split, tiles)))
        s = triton.cdiv(tiles, per)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), s)
    out, ws, cnt = launch_buffers(x.device, m, n, s, grid[0] * grid[1])
    b = bias if bias is not None else out
    h, lb, stride_hm, r, rp = lora_operands(lora, m, n, out)
    # sm_80 / sm_86 have no E4M3 convert: their scales decode by bit operations
    kernel, extra = nvfp4_swap_kernel, {"E4M3_CVT": torch.cuda.get_device_capability(x.device) >= (8, 9)}
    if wgmma:
        # imported here, not at the top: a Triton without the Hopper wgmma API still runs the mma.sync form
        from .nvfp4_wgmma import nvfp4_swap_wgmma_kernel, permute_x_kernel

        xperm = permute_x(current_policy(), m, n, k) if x_permuted is None else x_permuted
        kernel, extra = nvfp4_swap_wgmma_kernel, {"XP": xperm}
        if xperm:
            xp = alloc((m, k), x.device, torch.bfloat16)
            permute_x_kernel[(triton.cdiv(m, bm), k // (2 * bkh))](x, xp, m, k, x.stride(0), BN=bn, BM=bm, BKH=bkh,
                                                                    NW=4, num_warps=4, **pdl.launch_options(x))
            x = xp
    kernel[grid](x, packed, scale_u8, global_scale, b, out, m, n, k, x.stride(0), packed.stride(0),
                 scale_u8.stride(0), out.stride(0), ws, cnt, per, h, lb, stride_hm, r,
                 BN=bn, BM=bm, BKH=bkh, KW=kw, NS=ns, PARTIAL=s > 1, NW=4, SALIGN=salign,
                 HAS_BIAS=bias is not None, RP=rp, num_warps=4, **extra, **pdl.launch_options(x))
    return out


def call_on_stored_weight(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                          weight_global_scale: torch.Tensor, bias: torch.Tensor | None,
                          lora: tuple[torch.Tensor, torch.Tensor] | None, launch) -> torch.Tensor:
    """What every Gluon NVFP4 entry does around its launch: check the kernels' requirements (ValueError),
    flatten x [..., K] to 2-D, convert the stored weight's scales, call
    launch(x2 [M, K], packed, scale_u8, global_scale_f32, bias, sms, lora) -> [M, N] bf16, and restore x's
    leading dims. A LoRA term wider than the epilogue takes (`KernelPolicy.lora_in_kernel_max_r`) is not passed
    to the launch; one addmm adds it after."""
    k = x.shape[-1]
    if x.dtype != torch.bfloat16 or k % 128 or weight_packed.shape[1] * 2 != k:
        raise ValueError(f"Gluon NVFP4 kernel: bf16 x with K % 128 == 0 and packed [N, K/2], got {x.dtype}, "
                         f"K={k}, packed {tuple(weight_packed.shape)}")
    if not step_fits_bf16(weight_global_scale):
        raise ValueError("Gluon NVFP4 kernel: the global scale must be > 128 (bf16 decode step)")
    late = lora is not None and lora[0].shape[-1] > current_policy().lora_in_kernel_max_r
    n = weight_packed.shape[0]
    b = None if bias is None else bias.to(x.dtype).contiguous()
    lo = None if lora is None or late else (as_2d(lora[0]), lora[1].contiguous())
    y = launch(as_2d(x), weight_packed.contiguous(), scale_bytes(weight_scale), global_scale_f32(weight_global_scale),
               b, sm_count(x.device, 4), lo)
    y = y.reshape(*x.shape[:-1], n)
    return add_lora(y, lora) if late else y


def nvfp4_linear_gluon(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                       weight_global_scale: torch.Tensor, bias: torch.Tensor | None = None, *, wgmma: bool = False,
                       x_permuted: bool | None = None, config: SwapConfig | None = None, split: int | None = None,
                       lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] bf16 -> x @ W^T + bias (+ h @ lb^T for lora = (h [..., R], lb = scaling * B [N, R])), [..., N]
    bf16, for the NVFP4 weight as stored. The caller chose this backend (`route`): the kernel's requirements
    (module docstring) are checked here and a violation raises ValueError (`call_on_stored_weight`)."""
    def launch(x2, packed, scale_u8, gs, b, sms, lo):
        return nvfp4_linear_swap(x2, packed, scale_u8, gs, b, sms, config, split, lo, wgmma=wgmma,
                                 x_permuted=x_permuted)

    return call_on_stored_weight(x, weight_packed, weight_scale, weight_global_scale, bias, lora, launch)
