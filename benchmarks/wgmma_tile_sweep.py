"""Tile sweep of the sm_90 wgmma NVFP4 kernel (x pre-permuted) above 64 rows on Qwen2.5-7B shapes (GPU).

    PYTHONPATH=$PWD/src python benchmarks/wgmma_tile_sweep.py 128,256,512

First checks every config against the float32 reference at odd M (exit 1 on an error >= 1e-2 or a NaN), then
times each config (BN, BM, BKH, KW, NS) at 1-3 programs per SM with CUDA-graph replays, weights rotated through
> 2x L2, against cuBLAS bf16; one line per shape (the routed tile, the best) and the microseconds of every
config. Raw result: docs/results/wgmma_tile_sweep_h100_2026-11-25.txt.
"""
import sys
import torch
import torch.nn.functional as F
from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
from qerl.kernels import gluon_nvfp4 as gk
from qerl.kernels.operands import global_scale_f32, scale_bytes

LAYERS = {"gate_up": (37888, 3584), "down": (3584, 18944), "qkv": (4608, 3584), "o": (3584, 3584)}
CFGS = [(64, 128, 64, 16, 2), (128, 128, 64, 16, 2), (128, 128, 64, 16, 3), (128, 64, 64, 16, 3), (128, 64, 64, 16, 2),
        (64, 256, 64, 16, 2), (128, 128, 128, 16, 2)]
WAVES = [1.0, 2.0, 3.0]
MS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "128,256,512").split(",")]
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(torch.cuda.get_device_name(), flush=True)

def call(x, p, s, g, cfg, w):
    m, k = x.shape
    split = gk.split_for(m, p.shape[0], k, cfg, sms, w)[0]
    return gk.nvfp4_linear_swap(x, p, s, g, None, sms, config=cfg, split=split, wgmma=True, x_permuted=True)

# correctness of every config against the baseline, odd M
for name, (n, k) in LAYERS.items():
    from qerl.formats.nvfp4 import quantize_nvfp4, dequantize_nvfp4
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q = quantize_nvfp4(w)
    ref_w = dequantize_nvfp4(**q, dtype=torch.float32)
    p, s, g = q["weight_packed"], scale_bytes(q["weight_scale"]), global_scale_f32(q["weight_global_scale"])
    for m in (200, 333):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ ref_w.t()
        for cfg in CFGS:
            for wv in (1.0, 3.0):
                y = call(x, p, s, g, cfg, wv).float()
                err = ((y - ref).norm() / ref.norm()).item()
                if not (err < 1e-2) or torch.isnan(y).any():
                    print("FAIL", name, m, cfg, wv, err); sys.exit(1)
    del w, q, ref_w
print("correct: all configs", flush=True)
rows = []
for name, (n, k) in LAYERS.items():
    fp4_bytes, copies, bf, q = _rotated_weights(n, k, 50 * 2**20)
    ops = [(e["weight_packed"], scale_bytes(e["weight_scale"]), global_scale_f32(e["weight_global_scale"])) for e in q]
    for m in MS:
        xs, calls = _decode_inputs(m, k, fp4_bytes, copies)
        tc = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, 5)
        res = {}
        for cfg in CFGS:
            for wv in WAVES:
                try:
                    res[(cfg, wv)] = _graph_time(lambda i: call(xs[i % 2], *ops[i % copies], cfg, wv), calls, 5)
                except Exception as e:
                    res[(cfg, wv)] = float("nan"); print("fail", cfg, wv, type(e).__name__, str(e)[:150])
        base = res[((64, 128, 64, 16, 2), 2.0)]
        best = min((t, c) for c, t in res.items() if t == t)
        print(f"{name} M={m}: cuBLAS {tc*1e6:.1f} | base {base*1e6:.1f} ({tc/base:.2f}x) | best {best[1]} {best[0]*1e6:.1f} ({tc/best[0]:.2f}x)", flush=True)
        print("   " + " ".join(f"{c[0][:3]}w{c[1]:g}:{t*1e6:.0f}" for c, t in res.items()), flush=True)
    bf = q = ops = None
    torch.cuda.empty_cache()
