"""Can the wgmma swap-AB kernel take prefill-sized products (M = 128-1024) from dequantize + cuBLAS?

`python benchmarks/experimental/wgmma_swap/sweep_large_m.py [M,M,...] [--shapes 7b|all]` (GPU, sm_90). Above 64
rows the dispatch dequantizes the NVFP4 weight into a temporary and calls cuBLAS (issue 3's target there:
>= 0.95x cuBLAS bf16). The wgmma kernel (`gluon_nvfp4_wgmma`) accepts BM (its wgmma N) up to 256, so each
decoded weight tile feeds up to 256 activation rows; this times it with x pre-permuted over
BM {64, 128, 256} x (BKH, NS) x programs per SM {1, 2} (tiles that do not fit shared memory are skipped)
against cuBLAS bf16 and dequantize + cuBLAS. At M <= 64 it sweeps the routed BM with 2-4 stages and 2-4
programs per SM (the earlier sweeps, `sweep_tiles.py`, tried 3-4 stages only); --default times only the
routed tile (x as the router stages it). Every timed tile's output is checked against
dequantize + cuBLAS (max |diff| / max |ref|; a tile over 2e-2 is reported as WRONG and not ranked).
Same timing as `qerl bench kernels`: medians over CUDA-graph replays, weights rotated through > 2x L2.
"""

import argparse

import torch
import torch.nn.functional as F

from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
from qerl.kernels import gluon_nvfp4 as gk
from qerl.kernels import triton_nvfp4 as tk

L2 = 50 * 2**20
SHAPES_7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
SHAPES_BIG = [(8192, 8192), (8192, 29568), (55296, 5120)]
SMEM = 227 * 1024


def tiles(m: int):
    """Above 64 rows BM 64-256; up to 64 the routed BM (the next of 8, 16, 32, 64), 2-4 stages."""
    bms = (64, 128, 256) if m > 64 else (next(b for b in (8, 16, 32, 64) if b >= m),)
    for bm in bms:
        if bm > 2 * max(m, 64):
            continue
        for bkh, ns in ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3)):
            smem = ns * (2 * bm * bkh * 2 + 64 * bkh * 9 // 8)
            if smem <= SMEM:
                yield (64, bm, bkh, 16, ns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ms", nargs="?", default="128,256,1024")
    ap.add_argument("--shapes", default="7b", choices=["7b", "all"])
    ap.add_argument("--nk", default=None, help="comma list of NxK shapes instead of --shapes")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--default", action="store_true",
                    help="only the default tile (`gluon_nvfp4.pick_config_wgmma`): where does it stop beating "
                         "dequantize + cuBLAS")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    if not args.default:  # x rewritten once in operand order, then cp.async (the default above 64 rows too)
        gk.X_PERMUTED = True
    shapes = SHAPES_7B + (SHAPES_BIG if args.shapes == "all" else [])
    if args.nk:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.nk.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs")
    print("| N x K | M | cuBLAS us | deq+cuBLAS us | wgmma best us | x cuBLAS | x deq+cuBLAS | best tile (BN, BM, BKH, NS) "
          "waves split | max rel err | next 3 |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for n, k in shapes:
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
        for m in ms:
            xs, calls = _decode_inputs(m, k, fp4_bytes, copies)
            t_cub = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, args.replays)
            t_deq = _graph_time(lambda i: F.linear(xs[i % 2], tk.nvfp4_dequantize_triton(**q[i % copies])), calls,
                                args.replays)
            ref = F.linear(xs[0], tk.nvfp4_dequantize_triton(**q[0])).float()
            res, seen = [], set()
            for cfg in [None] if args.default else tiles(m):
                for waves in (None,) if cfg is None else ((1.0, 2.0) if m > 64 else (2.0, 3.0, 4.0)):
                    if cfg is None:
                        split = None
                        res_cfg = gk.pick_config_wgmma(m, n, k)[0]
                        waves_shown = gk.pick_config_wgmma(m, n, k)[1]
                    else:
                        res_cfg, waves_shown = cfg, waves
                        split = gk.split_for(m, n, k, cfg, sms, waves)[0]
                        if (cfg, split) in seen:
                            continue  # the same launch as a smaller wave count
                        seen.add((cfg, split))

                    def call(i, cfg=cfg, split=split):
                        return tk.nvfp4_linear_swap(xs[i % 2], **q[i % copies], config=cfg, split=split, wgmma=True)
                    try:
                        err = ((call(0).float() - ref).abs().max() / ref.abs().max()).item()
                        t = _graph_time(call, calls, args.replays)
                    except Exception as e:  # a tile this GPU cannot hold (shared memory, registers)
                        print(f"  {n}x{k} M={m} {cfg} waves {waves}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                        continue
                    if not err <= 2e-2:  # NaN fails too
                        print(f"  {n}x{k} M={m} {cfg} waves {waves}: WRONG, max rel err {err:.3g}", flush=True)
                        continue
                    res.append((t, res_cfg, waves_shown, split if split is not None else "default", err))
            if not res:
                print(f"| {n}x{k} | {m} | {t_cub * 1e6:.1f} | {t_deq * 1e6:.1f} | - | | | no tile ran | | |")
                continue
            res.sort(key=lambda r: r[0])
            t, cfg, waves, split, err = res[0]
            rest = "; ".join(f"{r[0] * 1e6:.1f} (BM{r[1][1]},BKH{r[1][2]},NS{r[1][4]}) w{r[2]:.0f}" for r in res[1:4])
            print(f"| {n}x{k} | {m} | {t_cub * 1e6:.1f} | {t_deq * 1e6:.1f} | {t * 1e6:.1f} | {t_cub / t:.2f} | "
                  f"{t_deq / t:.2f} | {cfg[:3]} NS{cfg[4]} w{waves:.0f} s{split} | {err:.1e} | {rest} |", flush=True)
            xs = ref = None
        bf = q = None  # free this shape's weights before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
