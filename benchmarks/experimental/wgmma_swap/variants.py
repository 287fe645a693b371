"""Which decode-kernel variants win, per row count: x prefetch and two warpgroups (GPU, sm_90).

`python benchmarks/experimental/wgmma_swap/variants.py [M,M,... [R]]` (default 8,16,32,48,64 and a rank-32 LoRA
term in the epilogue, as the rollout engine runs it; R = 0: none): for Qwen2.5 7B/32B/72B shapes prints cuBLAS
bf16 (no LoRA) and, in microseconds (CUDA-graph replays, weights rotated through > 2x L2, as
`qerl bench kernels`), the Gluon swap kernel's variants:
  mma.sync with its default tile, x loaded per step (`sync`) or one step ahead into registers (`sync+pf`);
  from M = 32: the wgmma form with one warpgroup (BN 64) or two sharing each x tile (BN 128, 8 warps), each
  with and without the prefetch, at 2 and 3 programs per SM.
Every variant's output is compared with the dequantized-weight product first (max relative error printed).
`gluon_nvfp4.X_PREFETCH`, `pick_config` and `pick_config_wgmma` were set from its output.
"""

import sys

import torch
import torch.nn.functional as F

from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
from qerl.formats.nvfp4 import dequantize_nvfp4
from qerl.kernels import gluon_nvfp4 as gk

L2 = 50 * 2**20
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (8192, 8192), (8192, 29568), (55296, 5120)]


def variants(m: int) -> dict:
    """name -> launcher keyword arguments."""
    out = {"sync": dict(x_prefetch=False), "sync+pf": dict(x_prefetch=True)}
    if m < 32:
        return out
    bm = 32 if m <= 32 else 64
    for pf in (False, True):
        tag = "+pf" if pf else ""
        for waves in (2.0, 3.0):
            out[f"wg64 w{waves:.0f}{tag}"] = dict(config=(64, bm, 64, 16, 3), waves=waves, wgmma=True, x_prefetch=pf)
            out[f"wg128x8 w{waves:.0f}{tag}"] = dict(config=(128, bm, 64, 16, 3, 8), waves=waves, wgmma=True,
                                                      x_prefetch=pf)
    return out


def main() -> None:
    ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8, 16, 32, 48, 64]
    r = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, LoRA rank {r}")
    rows = []
    for n, k in SHAPES:
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
        w0 = {"packed": q[0]["weight_packed"], "scale_u8": q[0]["weight_scale"].view(torch.uint8),
              "global_scale": q[0]["weight_global_scale"].reshape(1).float()}
        wref = dequantize_nvfp4(**q[0], dtype=torch.float32)
        for m in ms:
            xs, calls = _decode_inputs(m, k, fp4_bytes, copies)
            ref = xs[0].float() @ wref.t()
            lora = None
            if r:
                lora = ((torch.randn(m, r, device="cuda") * 0.5).bfloat16(),
                        (torch.randn(n, r, device="cuda") * 0.01).bfloat16())
                ref += lora[0].float() @ lora[1].float().t()
            res = {"cuBLAS": _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, 5)}
            errs = []
            for name, kw in variants(m).items():
                kw = dict(kw, lora=lora)
                waves = kw.pop("waves", None)
                if waves is not None:
                    kw["split"] = gk.split_for(m, n, k, kw["config"], sms, waves)[0]

                def call(i, kw=kw):
                    qi = q[i % copies]
                    return gk.nvfp4_linear_swap(xs[i % 2], qi["weight_packed"], qi["weight_scale"].view(torch.uint8),
                                                qi["weight_global_scale"].reshape(1).float(), None, sms, **kw)

                try:
                    y = gk.nvfp4_linear_swap(xs[0], **w0, bias=None, sms=sms, **kw)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    errs.append(err)
                    res[name] = _graph_time(call, calls, 5) if err < 2e-2 else float("nan")
                except Exception as e:  # a tile this GPU cannot hold
                    print(f"  {n}x{k} M={m} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best = min((v, kname) for kname, v in res.items() if kname != "cuBLAS" and v == v)
            rows.append((n, k, m, res, max(errs), best))
            print(f"{n}x{k} M={m} max err {max(errs):.2e} " +
                  " ".join(f"{kname} {v * 1e6:.1f}" for kname, v in res.items()) + f" | best {best[1]}", flush=True)
        bf = q = wref = None
        torch.cuda.empty_cache()
    print("\n| N x K | M | cuBLAS us | variant us (x cuBLAS) ... | best |")
    print("|---|---:|---:|---|---|")
    for n, k, m, res, err, best in rows:
        cub = res["cuBLAS"]
        cells = ", ".join(f"{kname} {v * 1e6:.1f} ({cub / v:.2f})" for kname, v in res.items() if kname != "cuBLAS")
        print(f"| {n}x{k} | {m} | {cub * 1e6:.1f} | {cells} | {best[1]} ({cub / best[0]:.2f}x) |")


if __name__ == "__main__":
    main()
