"""Which Gluon NVFP4 tile and K split is fastest for a small model's weights at rollout row counts (GPU).

`python benchmarks/small_weight_tiles.py [--model 1.5B] [--layers qkv,o,gate_up,down] [--m 48,64,96,128]
[--baseline-policy FIELD=VALUE,...] [--no-sweep] [--out FILE.json]`: for each layer of the model (`qerl.bench.kernels.MODEL_SHAPES`) and each row count, times
cuBLAS bf16, one dequantize pass + cuBLAS, the routed backend (`route.route` under the default policy), and
every tile candidate of the wgmma form (x staged and pre-permuted) and the mma.sync form at K splits
{1, 2, 3, 4, 6, 8}, in microseconds (CUDA-graph replays, weights rotated through > 2x L2, as `qerl bench
kernels`); --baseline-policy also times the routed backend under those `KernelPolicy` overrides (e.g. the
earlier rule: wide_m_tile=128,permute_x_min_weight=0,wide_m_min_k_tiles=1), --no-sweep skips the candidates.
Prints the default, the best candidate and cuBLAS per shape, and a table last. At hidden size 1536
the routed kernel at 65-128 rows runs about 2x cuBLAS (`qerl bench kernels --models 1.5B`); this finds whether
another tile or split closes that.
"""

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from qerl.bench.kernels import MODEL_SHAPES, _decode_inputs, _graph_time, _rotated_weights, layer_shapes
from qerl.kernels.gluon import nvfp4 as gk
from qerl.kernels import route as rt
from qerl.kernels.triton import fp4 as tk
from qerl.kernels.nvfp4_matmul import nvfp4_linear

L2 = 50 * 2**20
SPLITS = (1, 2, 3, 4, 6, 8)


def candidates(m: int):
    """(form, x_permuted, (BN, BM, BKH, KW, NS)) to try at m rows."""
    bms = sorted({min(128, max(8, 1 << (m - 1).bit_length())), 64})
    for bn, bm, bkh, ns, xp in itertools.product((64, 128), bms, (64, 128), (2, 3, 4), (False, True)):
        yield "wgmma", xp, (bn, bm, bkh, 16, ns)
    for bn, bkh, ns in itertools.product((64, 128), (64, 128), (3, 4)):
        yield "mma.sync", False, (bn, min(64, bms[0]), bkh, 16, ns)


def sweep_shape(name: str, n: int, k: int, ms, replays: int, baseline: dict | None, sweep: bool) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = torch.cuda.get_device_capability()
    fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
    rows = []
    for m in ms:
        xs, calls = _decode_inputs(m, k, fp4_bytes, copies)
        t_cub = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, replays)
        t_deq = _graph_time(lambda i: F.linear(xs[i % 2], tk.nvfp4_dequantize_triton(**q[i % copies])), calls,
                            replays)
        backend = rt.route("nvfp4", m, n, k, cap)
        t_routed = _graph_time(lambda i: nvfp4_linear(xs[i % 2], **q[i % copies]), calls, replays)
        t_base = None
        if baseline is not None:
            with rt.kernel_policy(**baseline):
                t_base = _graph_time(lambda i: nvfp4_linear(xs[i % 2], **q[i % copies]), calls, replays)
        tried = []
        for form, xp, cfg in candidates(m) if sweep else ():
            tiles = k // (2 * cfg[2])
            if k % (2 * cfg[2]):
                continue
            for s in sorted({min(s, tiles) for s in SPLITS}):
                try:
                    t = _graph_time(lambda i: gk.nvfp4_linear_gluon(
                        xs[i % 2], **q[i % copies], config=cfg, split=s, wgmma=form == "wgmma",
                        x_permuted=xp if form == "wgmma" else None), calls, replays)
                except Exception as e:  # a tile over the shared memory / register budget
                    print(f"  {form} xp={xp} {cfg} s{s}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    break
                tried.append({"form": form, "x_permuted": xp, "config": list(cfg), "split": s, "us": t * 1e6})
        tried.sort(key=lambda r: r["us"])
        row = {"layer": name, "N": n, "K": k, "M": m, "sms": sms, "routed": backend, "cublas_us": t_cub * 1e6,
               "deq_cublas_us": t_deq * 1e6, "routed_us": t_routed * 1e6,
               "baseline_us": None if t_base is None else t_base * 1e6, "best": tried[:5]}
        rows.append(row)
        base = "" if t_base is None else f" | baseline policy {t_base * 1e6:.1f}"
        best = "" if not tried else (f" | best {tried[0]['form']} xp={tried[0]['x_permuted']} "
                                     f"{tuple(tried[0]['config'])} s{tried[0]['split']} {tried[0]['us']:.1f}")
        print(f"{name} {n}x{k} M={m}: cuBLAS {t_cub * 1e6:.1f} | deq+cuBLAS {t_deq * 1e6:.1f} | routed ({backend}) "
              f"{t_routed * 1e6:.1f}{base}{best}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1.5B", choices=sorted(MODEL_SHAPES))
    p.add_argument("--layers", default="qkv,o,gate_up,down")
    p.add_argument("--m", default="48,64,96,128")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--baseline-policy", help="also time the routed backend under these KernelPolicy overrides")
    p.add_argument("--no-sweep", action="store_true", help="time cuBLAS and the routed backend only")
    p.add_argument("--out")
    a = p.parse_args()
    ms = [int(v) for v in a.m.split(",")]
    try:
        baseline = rt.parse_policy_overrides(a.baseline_policy) if a.baseline_policy else None
    except ValueError as e:
        p.error(f"--baseline-policy: {e}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    wanted = a.layers.split(",")
    shapes = {name: nk for name, nk in layer_shapes(a.model).items() if name in wanted}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name, (n, k) in shapes.items():
        rows += sweep_shape(name, n, k, ms, a.replays, baseline, not a.no_sweep)
        torch.cuda.empty_cache()
    print("\n| layer | M | cuBLAS us | deq+cuBLAS us | routed us (backend) | baseline policy us | best us | best form, "
          "x permuted, (BN,BM,BKH,KW,NS), split | routed x cuBLAS | best x cuBLAS |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        b = r["best"][0] if r["best"] else None
        base = "" if r["baseline_us"] is None else f"{r['baseline_us']:.1f}"
        best = " | |" if b is None else (f" {b['us']:.1f} | {b['form']}, {b['x_permuted']}, {tuple(b['config'])}, "
                                         f"s{b['split']} |")
        print(f"| {r['layer']} {r['N']}x{r['K']} | {r['M']} | {r['cublas_us']:.1f} | {r['deq_cublas_us']:.1f} | "
              f"{r['routed_us']:.1f} ({r['routed']}) | {base} |{best} {r['cublas_us'] / r['routed_us']:.2f} | "
              + ("" if b is None else f"{r['cublas_us'] / b['us']:.2f}") + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
