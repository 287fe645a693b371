"""GPU check + timing of the wgmma swap-AB NVFP4 kernel (qerl.kernels.gluon_nvfp4_wgmma) against the float32 reference, cuBLAS bf16
and the current mma.sync swap kernel.  Run:  python benchmarks/experimental/wgmma_swap/check_gpu.py [--quick]

(a) correctness: random raw codes/scales (all 16 codes, zero blocks, 448 and subnormal E4M3 scales), NaN-poisoned
    outputs and partials, M in 1/17/32/33/64, N not a multiple of the tile, K in {256, 1152, 3584}, with and
    without bias, split 1 and > 1, sync and async wgmma variants, several tiles;
(b) timing: CUDA-graph replay (as qerl.bench.kernels._graph_time), weights rotated through > 2x the 50 MB L2,
    Qwen2.5 shapes at M = 16, 32, 64; prints one table (best tile/split per kernel and the per-tile numbers).
"""

import math
import sys
import time

import torch
import triton

from qerl.formats.nvfp4 import dequantize_nvfp4
from qerl.kernels import triton_fp4_mm
from qerl.kernels import triton_nvfp4 as tk
from qerl.bench.kernels import _graph_time
from qerl.kernels.gluon_nvfp4 import _scale_align, split_for
from qerl.kernels.triton_fp4_mm import _alloc, splitk_reduce

from qerl.kernels.gluon_nvfp4_wgmma import nvfp4_swap_wgmma_kernel

KERNELS = {"sync": False, "async": True}  # mode -> the kernel's ASYNC flag
SMS = torch.cuda.get_device_properties(0).multi_processor_count
L2 = 50 * 2**20


def wg_linear(x, packed, scale_u8, gs, bias, cfg, split=None, waves=2.0, mode="sync"):
    """The launcher of gluon_nvfp4.nvfp4_linear_swap with the wgmma kernel. cfg = (BN, BM, BKH, NS)."""
    m, k = x.shape
    n = packed.shape[0]
    bn, bm, bkh, ns = cfg
    if k % (2 * bkh):
        raise ValueError("K not a multiple of the tile")
    tiles = k // (2 * bkh)
    if split is None:
        split = split_for(m, n, k, (bn, bm, bkh, 16, ns), SMS, waves)[0]
    per = triton.cdiv(tiles, max(1, min(split, tiles)))
    s = triton.cdiv(tiles, per)
    partial = s > 1
    out = _alloc((s, m, n), x.device, torch.float32) if partial else _alloc((m, n), x.device, torch.bfloat16)
    b = bias if bias is not None else out
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), s)
    nvfp4_swap_wgmma_kernel[grid](x, packed, scale_u8, gs, b, out, m, n, k, x.stride(0), packed.stride(0),
                                  scale_u8.stride(0), out.stride(-2), out.stride(0) if partial else 0, per,
                                  out, out, 0, 0, BN=bn, BM=bm, BKH=bkh, KW=16, NS=ns, PARTIAL=partial, NW=4,
                                  SALIGN=_scale_align(scale_u8.stride(0)), HAS_BIAS=bias is not None and not partial,
                                  RP=0, ASYNC=KERNELS[mode], num_warps=4)
    return splitk_reduce(out, bias, torch.bfloat16) if partial else out


def random_fp4(n, k, gen, gs):
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(0, 0x7F, (n, k // 16), generator=gen, dtype=torch.int32).to(torch.uint8)  # 0..448
    scale.view(-1)[:3] = torch.tensor([0x7E, 0x01, 0x07], dtype=torch.uint8)[: scale.numel()]  # 448, subnormals
    zero = torch.rand((n, k // 16), generator=gen) < 0.1
    packed.view(n, k // 16, 8)[zero] = 0
    scale[zero] = 0
    return packed.cuda(), scale.cuda(), torch.tensor([gs], dtype=torch.float32).cuda()


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check():
    triton_fp4_mm.POISON = True
    gen = torch.Generator().manual_seed(0)
    cfgs = [(128, 64, 64, 4), (64, 32, 64, 4), (128, 32, 128, 3), (64, 64, 128, 3), (128, 16, 64, 4)]
    shapes = [(1, 200, 256), (17, 1000, 1152), (32, 333, 3584), (33, 517, 1152), (64, 96, 3584), (64, 4608, 3584)]
    fails, n_ok, worst = [], 0, 0.0
    for si, (m, n, k) in enumerate(shapes):
        gs = [2688.0, 200.0, 1e25][si % 3]
        packed, scale, g = random_fp4(n, k, gen, gs)
        w = dequantize_nvfp4(packed, scale.view(torch.float8_e4m3fn), g, dtype=torch.float32)
        amax = w.abs().max().clamp_min(1e-30)
        x = (torch.randn(m, k, generator=gen).cuda() / amax).to(torch.bfloat16)
        bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16).cuda()
        for use_bias in (False, True):
            b = bias if use_bias else None
            ref = x.float() @ w.t() + (b.float() if use_bias else 0)
            for cfg in cfgs:
                if k % (2 * cfg[2]):
                    continue
                for split in (1, 3):
                    for mode in KERNELS:
                        try:
                            y = wg_linear(x, packed, scale, g, b, cfg, split, mode=mode)
                            torch.cuda.synchronize()
                            e = rel_err(y, ref)
                        except Exception as ex:  # compile/launch failure: report, go on
                            e, y = float("nan"), None
                            fails.append(f"{mode} {cfg} M={m} N={n} K={k}: {type(ex).__name__}: {str(ex)[:300]}")
                            continue
                        ok = y.shape == (m, n) and y.dtype == torch.bfloat16 and e < 1e-2
                        worst = max(worst, e)
                        if ok:
                            n_ok += 1
                        else:
                            fails.append(f"{mode} {cfg} split={split} bias={use_bias} M={m} N={n} K={k} gs={gs}: "
                                         f"rel err {e:.3g}")
    triton_fp4_mm.POISON = False
    print(f"correctness: {n_ok} ok, {len(fails)} failed, worst rel err of the ok ones {worst:.2e} (tol 1e-2)")
    for f in fails[:20]:
        print("  FAIL", f)
    return not fails


def graph_time(fn, calls, replays=10):
    return _graph_time(fn, calls, replays)


def bench(quick):
    shapes = [(4608, 3584), (37888, 3584), (3584, 18944), (10240, 8192), (59136, 8192), (8192, 29568)]
    ms = [16, 32, 64]
    if quick:
        shapes, ms = shapes[:2], [32, 64]
    rows = []
    gen = torch.Generator().manual_seed(1)
    for n, k in shapes:
        copies_q = max(2, math.ceil(2 * L2 / (n * k * 0.5625)) + 1)
        copies_b = max(2, math.ceil(2 * L2 / (n * k * 2)) + 1)
        q = [random_fp4(n, k, gen, 2688.0) for _ in range(copies_q)]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies_b)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_cub = graph_time(lambda i: torch.nn.functional.linear(x, wb[i % copies_b]), copies_b * 2)
            t_cur = graph_time(lambda i: tk.nvfp4_linear_swap(x, q[i % copies_q][0],
                                                               q[i % copies_q][1].view(torch.float8_e4m3fn),
                                                               q[i % copies_q][2], wgmma=False), copies_q * 2)
            bm = m
            res = []
            for bn, bkh, ns in [(128, 64, 4), (64, 64, 4), (128, 128, 3), (64, 128, 3)]:
                if k % (2 * bkh):
                    continue
                for mode in (["sync", "async"] if bkh == 64 else ["sync"]):
                    for waves in (2.0, 3.0):
                        cfg = (bn, bm, bkh, ns)
                        try:
                            t = graph_time(lambda i: wg_linear(x, *q[i % copies_q], None, cfg, None, waves, mode),
                                           copies_q * 2)
                        except Exception as ex:
                            print(f"  {n}x{k} M={m} {cfg} {mode}: {type(ex).__name__} {str(ex)[:200]}")
                            continue
                        res.append((t, f"{bn},{bm},{bkh},{ns} {mode} w{waves:g}"))
            res.sort()
            best = res[0] if res else (float("nan"), "-")
            rows.append((n, k, m, t_cub, t_cur, best, res))
            print(f"{n}x{k} M={m}: cuBLAS {t_cub * 1e6:.1f} us, current swap {t_cur * 1e6:.1f} us, wgmma best "
                  f"{best[0] * 1e6:.1f} us ({best[1]}) | " + "; ".join(f"{d} {t * 1e6:.1f}" for t, d in res), flush=True)
    print()
    print("| N x K | M | cuBLAS bf16 us | current swap us | wgmma best us (BN,BM,BKH,NS mode waves) | x cuBLAS current "
          "| x cuBLAS wgmma | wgmma vs current |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for n, k, m, t_cub, t_cur, best, _ in rows:
        print(f"| {n}x{k} | {m} | {t_cub * 1e6:.1f} | {t_cur * 1e6:.1f} | {best[0] * 1e6:.1f} ({best[1]}) | "
              f"{t_cub / t_cur:.2f} | {t_cub / best[0]:.2f} | {t_cur / best[0]:.2f} |")


if __name__ == "__main__":
    t0 = time.time()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    ok = check()
    print(f"[check took {time.time() - t0:.0f} s]", flush=True)
    if ok or "--bench-anyway" in sys.argv:
        bench("--quick" in sys.argv)
    print(f"[total {time.time() - t0:.0f} s]")
