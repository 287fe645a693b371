"""The bf16 decode kernel (`qerl.kernels.gluon_bf16`) against cuBLAS at decode sizes (GPU).

`python benchmarks/experimental/bf16_decode_sweep.py [M,M,...]` (default 1,8,16,32,64): for the Qwen2.5-7B
linear shapes (q/k/v and gate/up fused, o, down, lm_head) prints cuBLAS bf16 (`F.linear`), the kernel with its
default tile, and the fastest of BK {64, 128} x NS {3, 4, 5} x programs per SM {2, 3, 4} with the routed BM,
in microseconds and TB/s of weight bytes (medians over CUDA-graph replays, weights rotated through > 2x L2,
as `qerl bench kernels`). Every timed tile is checked against cuBLAS (max |diff| / max |ref| <= 1e-2).
"""

import sys

import torch
import torch.nn.functional as F

from qerl.bench.kernels import _graph_time
from qerl.kernels import gluon_bf16

L2 = 50 * 2**20
SHAPES = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944),
          ("lm_head", 152064, 3584)]


def main() -> None:
    ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,8,16,32,64").split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}")
    print("| layer | M | cuBLAS us (TB/s) | kernel default us (TB/s) | best us (BK, NS, waves) | x cuBLAS default / best |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, n, k in SHAPES:
        nbytes = 2 * n * k
        copies = min(16, max(1, -(-2 * L2 // nbytes)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        calls = copies * max(1, min(8, int(2e-3 * 3e12 // (nbytes * copies))))
        for m in ms:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            ref = F.linear(xs[0], ws[0]).float()
            t_cub = _graph_time(lambda i: F.linear(xs[i % 2], ws[i % copies]), calls, 5)

            def timed(cfg=None, split=None):
                y = gluon_bf16.bf16_linear_swap(xs[0], ws[0], None, sms, config=cfg, split=split).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                if not err <= 1e-2:
                    raise AssertionError(f"{name} M={m} {cfg} split {split}: max rel err {err:.3g}")
                return _graph_time(lambda i: gluon_bf16.bf16_linear_swap(xs[i % 2], ws[i % copies], None, sms,
                                                                         config=cfg, split=split), calls, 5)

            t_def = timed()
            bm = gluon_bf16.pick_config(m, n, k)[0][1]
            best, seen = (t_def, "default"), set()
            for bk in (64, 128):
                for ns in (3, 4, 5):
                    cfg = (64, bm, bk, ns)
                    for waves in (2, 3, 4):
                        tiles = -(-k // bk)
                        grid = -(-n // 64) * -(-m // bm)
                        split = max(1, min(tiles, -(-waves * sms // grid)))
                        if (cfg, split) in seen:
                            continue
                        seen.add((cfg, split))
                        try:
                            t = timed(cfg, split)
                        except AssertionError:
                            raise
                        except Exception as e:  # shared memory / registers
                            print(f"  {cfg} split {split}: {type(e).__name__}: {str(e)[:80]}")
                            continue
                        if t < best[0]:
                            best = (t, f"({bk}, {ns}, {waves})")
            print(f"| {name} {n}x{k} | {m} | {t_cub * 1e6:.1f} ({nbytes / t_cub / 1e12:.2f}) | "
                  f"{t_def * 1e6:.1f} ({nbytes / t_def / 1e12:.2f}) | {best[0] * 1e6:.1f} {best[1]} | "
                  f"{t_cub / t_def:.2f} / {t_cub / best[0]:.2f} |", flush=True)
        ws = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
