"""Tile and split sweep of the Gluon decode kernels at a few rows, per 7B shape (GPU).

`python benchmarks/experimental/sweep_small_m.py [M,M,...] [shape,...]` (default 1,8 and the four 7B
shapes): for each shape and row count, cuBLAS bf16, the routed default, and the fastest of the mma.sync form
over BN {64, 128, 256} x (BKH, NS) {(64, 4), (64, 6), (128, 3), (128, 4), (128, 6)} x splits
{1, 2, 3, 4, 6, 8, 12, 16}, and (sm_90, M >= 5) the wgmma form with x pre-permuted over BN {64, 128} x
(BKH, NS) {(64, 4), (128, 3), (128, 4)} x the same splits. Microseconds, CUDA-graph replays, weights rotated
through > 2x L2, as `qerl bench kernels`. Tiles that do not fit (shared memory, registers) are skipped.
"""

import sys

import torch
import torch.nn.functional as F

from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
from qerl.kernels import gluon_nvfp4 as gk
from qerl.kernels import triton_nvfp4 as tk

L2 = 50 * 2**20
SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def main() -> None:
    ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | M | cuBLAS us | routed us | best us | best tile (form, BN, BKH, NS, split) | next 3 |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name in names:
        n, k = SHAPES[name]
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
        for m in ms:
            xs, calls = _decode_inputs(m, k, fp4_bytes, copies)

            def timed(**kw):
                return _graph_time(lambda i: tk.nvfp4_linear_swap(xs[i % 2], **q[i % copies], **kw), calls, 5)

            t_cub = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, 5)
            t_def = timed()
            bm = 8 if m <= 8 else 16
            res = []
            forms = [(False, bn, bkh, ns) for bn in (64, 128, 256) for bkh, ns in
                     ((64, 4), (64, 6), (128, 3), (128, 4), (128, 6))]
            if hopper and m >= 5:
                forms += [(True, bn, bkh, ns) for bn in (64, 128) for bkh, ns in ((64, 4), (128, 3), (128, 4))]
            for wg, bn, bkh, ns in forms:
                for split in SPLITS:
                    if split > k // (2 * bkh):
                        continue
                    cfg = (bn, bm, bkh, 16, ns)
                    try:
                        gk.X_PERMUTED = True if wg else None
                        res.append((timed(config=cfg, split=split, wgmma=wg), wg, cfg, split))
                    except Exception as e:  # a tile this GPU cannot hold (shared memory, registers)
                        print(f"  {'wgmma' if wg else 'mma'} {cfg} split {split}: {type(e).__name__}", flush=True)
                        break
                    finally:
                        gk.X_PERMUTED = None
            res.sort(key=lambda r: r[0])

            def fmt(r):
                return f"{'wg' if r[1] else 'mma'} {r[2][0]} {r[2][2]} NS{r[2][4]} s{r[3]}"

            rest = "; ".join(f"{r[0] * 1e6:.1f} {fmt(r)}" for r in res[1:4])
            print(f"| {name} {n}x{k} | {m} | {t_cub * 1e6:.1f} | {t_def * 1e6:.1f} | {res[0][0] * 1e6:.1f} | "
                  f"{fmt(res[0])} | {rest} |", flush=True)
        bf = q = None  # free this shape's weights before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
