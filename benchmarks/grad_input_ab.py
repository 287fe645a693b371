"""A/B of the input gradient dY @ W: the NVFP4 kernel (`gluon.nvfp4_grad_input`), the routed path, cuBLAS bf16.

`PYTHONPATH=$PWD/src python benchmarks/grad_input_ab.py`: correctness against the float32 reference first (dY rows
1/257/1030, weights of 200/4608 rows x 3584 columns and 336 x 1056, all 16 FP4 codes, 1 or 3 splits of the
reduction, NaN-poisoned outputs; exit 1 on any failure), then CUDA-graph timings on Qwen2.5 7B/32B/72B shapes,
one markdown table. "routed" is `nvfp4_matmul.nvfp4_linear_grad_input` as the training backward calls it
(whatever `route` picks); "deq+cuBLAS" dequantizes W into a temporary and multiplies (what it routed to before
this kernel existed); every time is microseconds per call with the weights rotated through more than twice the L2.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wgmma_ws_ab import LAYERS, L2, _random_weight, gate  # noqa: E402

DEFAULT_LAYERS = "gate_up,down,qkv,o,gate_up_72b,down_72b"


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true", help="correctness only")
    ap.add_argument("--bench-only", action="store_true", help="timing only (skip correctness)")
    ap.add_argument("--ms", default="256,1024,4096,8192", help="dY rows to time")
    ap.add_argument("--layers", default=DEFAULT_LAYERS, help=f"subset of {','.join(LAYERS)}")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--waves", default="1", help="programs per SM (splits of the reduction) for the kernel")
    ap.add_argument("--configs", default="64,128,4,4,112 256,64,4,2,232 256,128,3,2,232",
                    help="kernel tiles BM,BNR,NS,NC,CREGS separated by spaces (`nvfp4_grad_input_ws`)")
    ap.add_argument("--dry-run", action="store_true", help="parse arguments, print the plan, exit")
    a = ap.parse_args(argv)
    a.ms = [int(v) for v in a.ms.split(",")]
    a.layers = [v for v in a.layers.split(",") if v]
    a.waves = [float(v) for v in a.waves.split(",")]
    a.configs = [tuple(int(v) for v in c.split(",")) for c in a.configs.split()]
    bad = [v for v in a.layers if v not in LAYERS]
    if bad:
        ap.error(f"unknown layers {bad}")
    if any(len(c) != 5 for c in a.configs):
        ap.error("each config is BM,BNR,NS,NC,CREGS")
    return a


def _variants(a):
    """(column name, kind, config, waves): 'routed', 'deq' (dequantize + cuBLAS), 'kernel'."""
    out = [("routed", "routed", None, 0.0), ("deq+cuBLAS", "deq", None, 0.0)]
    out += [(f"kernel BM{c[0]} BNR{c[1]} NS{c[2]} NC{c[3]} w{w:g}", "kernel", c, w) for c in a.configs for w in a.waves]
    return out


def _call(kind, cfg, waves, g, w, sms, split=None):
    from qerl.kernels.gluon import nvfp4_grad_input as gi
    from qerl.kernels.triton import fp4 as tk
    from qerl.kernels.nvfp4_matmul import nvfp4_linear_grad_input
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    if kind == "routed":
        return nvfp4_linear_grad_input(g, **w)
    if kind == "deq":
        return g @ tk.nvfp4_dequantize_triton(**w, dtype=torch.bfloat16)
    return gi.nvfp4_grad_input_ws(g, w["weight_packed"], scale_bytes(w["weight_scale"]),
                                  global_scale_f32(w["weight_global_scale"]), sms, config=cfg, split=split, waves=waves)


def check(a) -> list[str]:
    from qerl.formats.nvfp4 import dequantize_nvfp4
    from qerl.kernels.route import sm_count

    sms = sm_count(torch.device("cuda"), 4)
    kernels = [(f"kernel BM{c[0]} BNR{c[1]} NS{c[2]} NC{c[3]}", c) for c in sorted({(128, 64, 4, 2, 232), *a.configs})]
    fails, worst = [], {}
    for n, k in ((200, 3584), (4608, 3584), (336, 1056)):
        for m in (1, 257, 1030):
            gen = torch.Generator().manual_seed(1000 * m + n)
            wc = _random_weight(n, k, gen)
            ref = torch.randn(m, n, generator=gen).to(torch.bfloat16)
            g = ref.cuda()
            ref = ref.float() @ dequantize_nvfp4(**wc, dtype=torch.float32)
            w = {name: t.cuda() for name, t in wc.items()}
            for split in (1, 3):
                for name, cfg in kernels:
                    gate(name, f"{name}: M={m} N={n} K={k} split={split}",
                         lambda: _call("kernel", cfg, 1.0, g, w, sms, split=split), ref, (m, k), fails, worst)
    print("worst relative error per tile: " + ", ".join(f"{k_}: {v:.3e}" for k_, v in worst.items()))
    return fails


def bench(a) -> None:
    from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}", flush=True)
    variants = _variants(a)
    rows = []
    for layer in a.layers:
        n, k = LAYERS[layer]
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
        for m in a.ms:
            gs, calls = _decode_inputs(m, n, fp4_bytes, copies)
            t_cub = _graph_time(lambda i: gs[i % 2] @ bf[i % copies], calls, a.replays)
            times = {}
            for name, kind, cfg, waves in variants:
                def fn(i, kind=kind, cfg=cfg, waves=waves):
                    return _call(kind, cfg, waves, gs[i % 2], q[i % copies], sms)
                try:
                    times[name] = _graph_time(fn, calls, a.replays)
                except Exception as e:  # noqa: BLE001 - e.g. out of resources: report and go on
                    print(f"  {layer} M={m} {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    times[name] = float("nan")
            rows.append((layer, m, t_cub, times))
            print(f"{layer} M={m}: cuBLAS {t_cub * 1e6:.1f} us | " + " | ".join(
                f"{nm} {t * 1e6:.1f} ({t_cub / t:.2f}x)" for nm, t in times.items()), flush=True)
        bf = q = None
        torch.cuda.empty_cache()
    names = [v[0] for v in variants]
    print("\ndY @ W, microseconds per call (CUDA-graph replay); (x) = cuBLAS time / time, > 1 is faster than cuBLAS\n")
    print("| layer (N, K) | M | cuBLAS bf16 | " + " | ".join(names) + " |")
    print("|---|---:|---:|" + "---:|" * len(names))
    for layer, m, t_cub, times in rows:
        cells = [f"{times[nm] * 1e6:.1f} ({t_cub / times[nm]:.2f}x)" for nm in names]
        print(f"| {layer} {LAYERS[layer]} | {m} | {t_cub * 1e6:.1f} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    a = _args(argv)
    if a.dry_run:
        print(f"layers {a.layers}, M {a.ms}, variants {[v[0] for v in _variants(a)]}")
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    if not a.bench_only:
        fails = check(a)
        if fails:
            print("\n".join(["FAILED:"] + fails))
            return 1
    if not a.check_only:
        bench(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
