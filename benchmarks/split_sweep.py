"""How many K splits the Gluon decode kernel should use, per shape and row count (GPU).

`python benchmarks/split_sweep.py [M,M,...]` (default 1,8,16,32,64): for the Qwen2.5 layer shapes the rollout
engine runs (q/k/v and gate/up fused), times the routed Gluon kernel (`gluon.nvfp4.nvfp4_linear_gluon`: the
mma.sync or wgmma form, as `route.route` picks it on this GPU) with its default tile at its default split and at
splits {1, 2, 3, 4, 6, 8, 12}, in microseconds (CUDA-graph replays, weights rotated through > 2x L2, as
`qerl bench kernels`), and prints the best split with the programs per SM it gives. `gluon.nvfp4.split_for`
was tuned from its output.
"""

import sys

import torch
import torch.nn.functional as F

from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
from qerl.kernels.gluon import nvfp4 as gk
from qerl.kernels import route as rt

L2 = 50 * 2**20
SHAPES = {"7B qkv": (4608, 3584), "7B o": (3584, 3584), "7B gate_up": (37888, 3584), "7B down": (3584, 18944),
          "32B qkv": (7168, 5120), "32B gate_up": (55296, 5120), "32B down": (5120, 27648), "72B o": (8192, 8192)}
SPLITS = (1, 2, 3, 4, 6, 8, 12)


def main() -> None:
    ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8, 16, 32, 64]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}")
    out = []
    for name, (n, k) in SHAPES.items():
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
        for m in ms:
            xs, calls = _decode_inputs(m, k, fp4_bytes, copies)
            wg = rt.route("nvfp4", m, n, k, torch.cuda.get_device_capability()) in (rt.GLUON_WGMMA, rt.GLUON_WGMMA_XP)
            cfg, waves = (gk.pick_config_wgmma if wg else gk.pick_config)(m, n, k)
            s_def = gk.split_for(m, n, k, cfg, sms, waves)[0]
            t_cub = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, 5)
            times = {}
            tiles = k // (2 * cfg[2])
            for s in sorted({s_def, *[s for s in SPLITS if s <= tiles]}):
                times[s] = _graph_time(lambda i: gk.nvfp4_linear_gluon(xs[i % 2], **q[i % copies], config=cfg,
                                                                        split=s, wgmma=wg), calls, 5)
            best = min(times, key=times.get)
            grid = -(-n // cfg[0]) * -(-m // cfg[1])
            per = {s: -(-tiles // (-(-tiles // s))) for s in times}  # splits actually launched
            row = (name, m, wg, t_cub, s_def, times, best, grid, per)
            out.append(row)
            cells = " ".join(f"s{s}:{t * 1e6:.1f}" for s, t in times.items())
            print(f"{name} M={m} {'wgmma' if wg else 'mma.sync'} {cfg} grid {grid} | cuBLAS {t_cub * 1e6:.1f} | "
                  f"default s{s_def} {times[s_def] * 1e6:.1f} | {cells} | best s{best}", flush=True)
        bf = q = None
        torch.cuda.empty_cache()
    print("\n| layer | M | form | n-tiles x m-tiles | cuBLAS us | default split: us (programs/SM) | best split: us "
          "(programs/SM) | gain |")
    print("|---|---:|---|---:|---:|---|---|---:|")
    for name, m, wg, t_cub, s_def, times, best, grid, per in out:
        print(f"| {name} | {m} | {'wgmma' if wg else 'mma.sync'} | {grid} | {t_cub * 1e6:.1f} | "
              f"s{per[s_def]} {times[s_def] * 1e6:.1f} "
              f"({grid * per[s_def] / sms:.1f}) | s{per[best]} {times[best] * 1e6:.1f} ({grid * per[best] / sms:.1f}) "
              f"| {times[s_def] / times[best]:.2f}x |")


if __name__ == "__main__":
    main()
