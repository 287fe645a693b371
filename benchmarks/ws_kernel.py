"""The warp-specialized NVFP4 kernel (`qerl.kernels.gluon_nvfp4_ws`) against cuBLAS bf16, dequantize + cuBLAS and
the routed NVFP4 path, with its two counterfactuals (zero tiles instead of the decode; no wgmma), on the Qwen2.5-7B
linear shapes at prefill / loss-pass rows. Checks the kernel against the float64 reference first (odd M and N
tails, bias, all 16 FP4 codes, zero blocks). Prints a markdown table (microseconds, triton.testing.do_bench
median, L2 flushed between calls).

    python benchmarks/ws_kernel.py [--m 256,1024,4096,8192] [--configs 256,128,64,4,4,8,4,128,8 ...]
"""

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="256,1024,4096,8192")
    ap.add_argument("--configs", nargs="*", default=[], help="WsConfig tuples as comma lists (default: the kernel's)")
    args = ap.parse_args()
    import triton
    from test_kernels_triton import _random_fp4

    from qerl.formats.nvfp4 import dequantize_nvfp4
    from qerl.kernels import gluon_nvfp4_ws as W
    from qerl.kernels import triton_fp4 as tk
    from qerl.kernels.nvfp4_matmul import nvfp4_linear
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    cfgs = [tuple(int(v) for v in c.split(",")) for c in args.configs] or [W.DEFAULT_CONFIG]
    gen = torch.Generator().manual_seed(0)

    def operands(w):
        return w["weight_packed"], scale_bytes(w["weight_scale"]), global_scale_f32(w["weight_global_scale"])

    for m, n, k in [(77, 200, 256), (300, 4608, 3584), (1, 64, 128), (129, 130, 640)]:
        w = {a: t.cuda() for a, t in _random_fp4(n, k, 16, False, gen, 900.0).items()}
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        b = (torch.randn(n, generator=gen) * 0.1).bfloat16().cuda()
        ref = x.double() @ dequantize_nvfp4(**w, dtype=torch.float32).double().t() + b.double()
        for cfg in cfgs:
            y = W.nvfp4_linear_ws(x, *operands(w), b, config=cfg)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2 or torch.isnan(y).any():
                raise SystemExit(f"wrong result: M={m} N={n} K={k} {cfg}: relative error {err:.3g}")

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=200) * 1e3

    print(f"{torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; `python benchmarks/ws_kernel.py {' '.join(sys.argv[1:])}`")
    print("\n| shape (N x K) | M | config | cuBLAS bf16 | deq + cuBLAS | routed | ws | ws, zero tiles | ws, no wgmma "
          "| ws x cuBLAS | ws x routed |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    shapes = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
    for name, (n, k) in shapes.items():
        w = {a: t.cuda() for a, t in _random_fp4(n, k, 16, False, gen, 900.0).items()}
        wb = dequantize_nvfp4(**w, dtype=torch.bfloat16)
        ops = operands(w)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, generator=gen).bfloat16().cuda()
            tc = bench(lambda: F.linear(x, wb))
            td = bench(lambda: F.linear(x, tk.nvfp4_dequantize_triton(**w)))
            tr = bench(lambda: nvfp4_linear(x, **w))
            for cfg in cfgs:
                t = [bench(lambda: W.nvfp4_linear_ws(x, *ops, None, config=cfg, skip=s)) for s in (None, "decode", "mma")]
                print(f"| 7B {name} {n}x{k} | {m} | {','.join(map(str, cfg))} | {tc:.0f} | {td:.0f} | {tr:.0f} | "
                      + " | ".join(f"{v:.0f}" for v in t) + f" | {tc / t[0]:.2f} | {tr / t[0]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
