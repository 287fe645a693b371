"""Tile sweep of the sm_90 wgmma NVFP4 kernel (x pre-permuted) above 64 rows on Qwen2.5-7B shapes (GPU).

    PYTHONPATH=$PWD/src python benchmarks/wgmma_tile_sweep.py --ms 128,256,512

First checks every config against the float32 reference at odd M (exit 1 on an error >= 1e-2 or a NaN), then
times each config (BN, BM, BKH, KW, NS) at 1-3 programs per SM (the K split `split_for` gives) with CUDA-graph
replays, weights rotated through > 2x L2, against cuBLAS bf16 on the same weights. Prints one markdown table per
shape: microseconds and cuBLAS time / kernel time (> 1: faster than cuBLAS). `route` sends 65-256 rows to the
first config at 2 programs per SM (`gluon.nvfp4.pick_config_wgmma`). Raw result (the same measurement, printed
by this script's first form in commit f5c6fef): docs/results/wgmma_tile_sweep_h100_2026-11-25.txt.
"""

import argparse
import sys

import torch
import torch.nn.functional as F

LAYERS = {"gate_up": (37888, 3584), "down": (3584, 18944), "qkv": (4608, 3584), "o": (3584, 3584)}
ROUTED = (64, 128, 64, 16, 2)
CONFIGS = [ROUTED, (128, 128, 64, 16, 2), (128, 128, 64, 16, 3), (128, 64, 64, 16, 3), (128, 64, 64, 16, 2),
           (64, 256, 64, 16, 2), (128, 128, 128, 16, 2)]
WAVES = (1.0, 2.0, 3.0)


def launch(x, packed, scales, gscale, cfg, waves, sms):
    """x [M, K] bf16 @ W^T through the wgmma form with tile cfg and the K split for ~waves programs per SM."""
    from qerl.kernels.gluon import nvfp4 as gk

    m, k = x.shape
    split = gk.split_for(m, packed.shape[0], k, cfg, sms, waves)[0]
    return gk.nvfp4_linear_swap(x, packed, scales, gscale, None, sms, config=cfg, split=split, wgmma=True,
                                x_permuted=True)


def check(sms) -> bool:
    """Every config and 1 / 3 programs per SM against the float32 reference at M = 200 and 333."""
    from qerl.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    for name, (n, k) in LAYERS.items():
        q = quantize_nvfp4(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        ref_w = dequantize_nvfp4(**q, dtype=torch.float32)
        ops = (q["weight_packed"], scale_bytes(q["weight_scale"]), global_scale_f32(q["weight_global_scale"]))
        for m in (200, 333):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ ref_w.t()
            for cfg in CONFIGS:
                for waves in (1.0, 3.0):
                    y = launch(x, *ops, cfg, waves, sms).float()
                    err = ((y - ref).norm() / ref.norm()).item()
                    if not err < 1e-2 or torch.isnan(y).any():
                        print(f"FAIL {name} M={m} {cfg} w{waves:g}: relative error {err:.3e}", file=sys.stderr)
                        return False
    return True


def sweep(ms, sms, replays: int) -> None:
    from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    for name, (n, k) in LAYERS.items():
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, 50 * 2**20)
        ops = [(e["weight_packed"], scale_bytes(e["weight_scale"]), global_scale_f32(e["weight_global_scale"]))
               for e in q]
        print(f"\n### {name} (N, K) = ({n}, {k}): us (cuBLAS / kernel)\n")
        print("| M | cuBLAS | " + " | ".join(f"{c} w{w:g}" for c in CONFIGS for w in WAVES) + " | best |")
        print("|---:|---:|" + "---:|" * (len(CONFIGS) * len(WAVES)) + "---|")
        for m in ms:
            xs, calls = _decode_inputs(m, k, fp4_bytes, copies)
            t_cublas = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, replays)
            times = {}
            for cfg in CONFIGS:
                for waves in WAVES:
                    try:
                        times[cfg, waves] = _graph_time(
                            lambda i, c=cfg, w=waves: launch(xs[i % 2], *ops[i % copies], c, w, sms), calls, replays)
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report and go on
                        print(f"<!-- {cfg} w{waves:g}: {type(e).__name__}: {str(e)[:150]} -->")
                        times[cfg, waves] = float("nan")
            best = min((t, c) for c, t in times.items() if t == t)
            cells = [f"{t * 1e6:.1f} ({t_cublas / t:.2f}x)" for t in times.values()]
            print(f"| {m} | {t_cublas * 1e6:.1f} | " + " | ".join(cells) + f" | {best[1][0]} w{best[1][1]:g} |",
                  flush=True)
        bf = q = ops = None
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="128,256,512", help="activation rows")
    ap.add_argument("--replays", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        ap.error("needs an sm_90 GPU (wgmma)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if not check(sms):
        return 1
    print("every config matches the float32 reference")
    sweep([int(v) for v in args.ms.split(",")], sms, args.replays)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
