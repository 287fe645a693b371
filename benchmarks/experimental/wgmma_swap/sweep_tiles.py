"""Tile sweep of the routed wgmma decode kernel (`qerl.kernels.gluon_nvfp4_wgmma`) at one row count.

`python benchmarks/experimental/wgmma_swap/sweep_tiles.py [M]` (default 64; GPU, sm_90): for Qwen2.5 7B/32B/72B
shapes prints cuBLAS bf16, the mma.sync kernel, the wgmma kernel with its default tile, and the fastest of
BN {64, 128} x (BKH, NS) {(64, 4), (64, 3), (128, 3), (128, 4)} x programs per SM {2, 3, 4}, with BM (the wgmma N)
the next of 8, 16, 32, 64 above M (microseconds, CUDA-graph replays, weights rotated through > 2x L2, as
`qerl bench kernels`). `gluon_nvfp4.pick_config_wgmma` was chosen from its output (an earlier version swept
BN 256 and 1 program per SM too, at M = 64 only: never best).
"""

import sys

import torch
import torch.nn.functional as F

from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
from qerl.kernels import gluon_nvfp4 as gk
from qerl.kernels import triton_nvfp4 as tk

L2 = 50 * 2**20
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (8192, 8192), (8192, 29568), (55296, 5120)]


def main() -> None:
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}")
    print("| N x K | M | cuBLAS us | mma.sync us | wgmma default us | wgmma best us (BN, BM, BKH) NS waves split | next 3 |")
    print("|---|---:|---:|---:|---:|---|---|")
    for n, k in SHAPES:
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
        xs, calls = _decode_inputs(m, k, fp4_bytes, copies)

        def timed(**kw):
            return _graph_time(lambda i: tk.nvfp4_linear_swap(xs[i % 2], **q[i % copies], **kw), calls, 5)

        t_cub = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, 5)
        t_mma, t_wg = timed(wgmma=False), timed(wgmma=True)
        res = []
        bm = 8 if m <= 8 else (16 if m <= 16 else (32 if m <= 32 else 64))
        for bn in (64, 128):
            for bkh, ns in ((64, 4), (64, 3), (128, 3), (128, 4)):
                for waves in (2.0, 3.0, 4.0):
                    cfg = (bn, bm, bkh, 16, ns)
                    split = gk.split_for(m, n, k, cfg, sms, waves)[0]
                    try:
                        res.append((timed(config=cfg, split=split, wgmma=True), cfg, waves, split))
                    except Exception as e:  # a tile this GPU cannot hold (shared memory, registers)
                        print(f"  {cfg} waves {waves}: {type(e).__name__}")
        res.sort(key=lambda r: r[0])
        t, cfg, waves, split = res[0]
        rest = "; ".join(f"{r[0] * 1e6:.1f} ({r[1][0]},{r[1][2]}) NS{r[1][4]} w{r[2]}" for r in res[1:4])
        print(f"| {n}x{k} | {m} | {t_cub * 1e6:.1f} | {t_mma * 1e6:.1f} | {t_wg * 1e6:.1f} | {t * 1e6:.1f} "
              f"{cfg[:3]} NS{cfg[4]} w{waves} s{split} | {rest} |", flush=True)
        bf = q = None  # free this shape's weights before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
