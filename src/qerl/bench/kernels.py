"""Benchmark the fused NVFP4 kernels against cuBLAS bf16 on linear shapes (`qerl bench kernels`): CUDA-graph
replays cycling weight copies that exceed twice the L2 cache; the columns: docs/cli.md ("qerl bench kernels |
rollout | step")."""

import argparse
import dataclasses
import datetime
import functools
import json
import sys

import torch
import torch.nn.functional as F

from .options import md_header
from .graph_timing import calls_per_graph, copy_bandwidth, free_weights, graph_time as _graph_time, rotated_weights
from ..models.shapes import QWEN25, SMOLLM2_135M, linear_shapes

# Qwen2.5 sizes (named 1.5B, ..., 72B here), and SmolLM2-135M (the embedded model)
MODEL_SHAPES = {**{size.upper(): shape for size, shape in QWEN25.items()}, "SmolLM2": SMOLLM2_135M}
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
BACKWARD_M = (16, 256, 1024, 4096)


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """{layer: (N, K)} for y[M, N] = x[M, K] @ W[N, K]^T."""
    return linear_shapes(MODEL_SHAPES[model])


def bench_shape(n: int, k: int, ms, backward_ms, l2_bytes: int, replays: int, config=None) -> list[dict]:
    """cuBLAS bf16, dequantize + cuBLAS, the tl.dot kernel ("fused") and what `nvfp4_linear` /
    `nvfp4_linear_grad_input` route the product to ("routed": the swap-AB kernels, the CUDA-core gemv, the
    tl.dot kernel or dequantize + cuBLAS, by `qerl.kernels.route`)."""
    from qerl.kernels.triton import fp4 as tk
    from qerl.kernels.nvfp4_matmul import nvfp4_linear, nvfp4_linear_grad_input

    fp4_bytes, copies, bf, q = rotated_weights(n, k, l2_bytes)
    rows = []
    for kind, m_list in (("forward", ms), ("grad_input", backward_ms)):
        for m in m_list:
            red, out = (k, n) if kind == "forward" else (n, k)
            xs = [torch.randn(m, red, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            act = 2 * m * (red + out)
            calls = calls_per_graph(fp4_bytes, copies)
            # forward: x @ W^T; grad_input: dY @ W (torch.matmul is what `@` runs)
            dense, fused, routed = ((F.linear, tk.nvfp4_linear_triton, nvfp4_linear) if kind == "forward" else
                                    (torch.matmul, tk.nvfp4_grad_input_triton, nvfp4_linear_grad_input))
            fns = {"cublas": lambda i: dense(xs[i % 2], bf[i % copies]),
                   "deq+cublas": lambda i: dense(xs[i % 2], tk.nvfp4_dequantize_triton(**q[i % copies])),
                   "fused": lambda i: fused(xs[i % 2], **q[i % copies], config=config),
                   "routed": lambda i: routed(xs[i % 2], **q[i % copies])}
            t = {name: _graph_time(fn, calls, replays) for name, fn in fns.items()}
            rows.append({
                "kind": kind, "N": n, "K": k, "M": m, **{f"t_{a}_us": v * 1e6 for a, v in t.items()},
                "speedup_vs_cublas": t["cublas"] / t["fused"], "speedup_vs_deq": t["deq+cublas"] / t["fused"],
                "bw_fused": (fp4_bytes + act) / t["fused"], "bw_cublas": (2 * n * k + act) / t["cublas"],
                "tflops_fused": 2 * m * n * k / t["fused"] / 1e12,
                "routed_vs_cublas": t["cublas"] / t["routed"], "routed_vs_deq": t["deq+cublas"] / t["routed"],
            })
    free_weights(bf, q)
    return rows


def sweep(n: int, k: int, m: int, kind: str, configs, l2_bytes: int, replays: int) -> list[tuple[float, object]]:
    """Time the fused kernel with each TileConfig (split 0 = the automatic split); (us, config), fastest first."""
    from qerl.kernels.triton import fp4 as tk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, copies, _, q = rotated_weights(n, k, l2_bytes)
    red, out = (k, n) if kind == "forward" else (n, k)
    x = torch.randn(m, red, device="cuda", dtype=torch.bfloat16)
    res = []
    for cfg in configs:
        if cfg.split == 0:
            auto = tk.pick_config(m, out, red, sms)
            tiles = -(-out // cfg.bn) * -(-m // cfg.bm)
            split = tk._split_for(tiles, -(-red // cfg.bk), sms) if auto.split > 1 or m <= 64 else 1
            cfg = dataclasses.replace(cfg, split=split)
        fn = tk.nvfp4_linear_triton if kind == "forward" else tk.nvfp4_grad_input_triton
        try:
            t = _graph_time(lambda i: fn(x, **q[i % copies], config=cfg), copies * 2, replays)
        except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped
            print(f"  {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
            continue
        res.append((t * 1e6, cfg))
    return sorted(res, key=lambda r: r[0])


DECODE_M = (1, 2, 4, 8, 16)


def gemv_candidates():
    from qerl.kernels.triton.fp4_gemv import GemvConfig as G

    return [G(256, 4, 4), G(512, 4, 4), G(256, 4, 8), G(512, 4, 8), G(256, 4, 4, waves=8), G(128, 4, 2)]


def _decode_inputs(m: int, k: int, fp4_bytes: int, copies: int, replays: int):
    """Two activations [m, k] to alternate, and time(fn) -> median seconds per call of fn(i) over graphs of
    calls that read every weight copy and make >= ~2 ms of work."""
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    return xs, functools.partial(_graph_time, calls=calls_per_graph(fp4_bytes, copies), replays=replays)


def _fastest(best: tuple, candidates, seconds, label=str) -> tuple:
    """(seconds, candidate) of the fastest of best and each candidate, seconds(candidate) timing it; a candidate
    that does not run (shared memory, registers) is printed and skipped."""
    for c in candidates:
        try:
            t = seconds(c)
        except Exception as e:
            print(f"  {label(c)}: failed {type(e).__name__}: {str(e)[:100]}")
            continue
        if t < best[0]:
            best = (t, c)
    return best


def bench_decode(n: int, k: int, ms, l2_bytes: int, replays: int, candidates) -> list[dict]:
    """Decode sizes: cuBLAS bf16 vs the fused tensor-core kernel vs the CUDA-core gemv kernel (default
    config, and the fastest of `candidates`), weights rotated through > 2x L2 as in `bench_shape`."""
    from qerl.kernels.triton import fp4 as tk

    fp4_bytes, copies, bf, q = rotated_weights(n, k, l2_bytes)
    rows = []
    for m in ms:
        xs, time = _decode_inputs(m, k, fp4_bytes, copies, replays)
        t = {"cublas": time(lambda i: F.linear(xs[i % 2], bf[i % copies])),
             "fused": time(lambda i: tk.nvfp4_linear_triton(xs[i % 2], **q[i % copies])),
             "gemv": time(lambda i: tk.nvfp4_linear_gemv(xs[i % 2], **q[i % copies]))}
        best = _fastest((t["gemv"], None), candidates,
                        lambda c: time(lambda i: tk.nvfp4_linear_gemv(xs[i % 2], **q[i % copies], config=c)))
        act, c = 2 * m * (n + k), best[1]
        rows.append({"N": n, "K": k, "M": m, **{f"t_{a}_us": v * 1e6 for a, v in t.items()},
                     "t_gemv_best_us": best[0] * 1e6,
                     "best_cfg": None if c is None else [c.bn, c.bkw, c.warps, c.split, c.waves],
                     "x_gemv": t["cublas"] / t["gemv"], "x_gemv_best": t["cublas"] / best[0],
                     "x_fused": t["cublas"] / t["fused"], "bw_gemv_best": (fp4_bytes + act) / best[0],
                     "bw_cublas": (2 * n * k + act) / t["cublas"]})
    free_weights(bf, q)
    return rows


SWAP_M = (1, 2, 4, 8, 16, 32, 64)


def swap_candidates(m: int):
    """(config, waves) pairs for the Gluon swap-AB kernel at m rows: tile shapes x programs per SM."""
    bm = 8 if m <= 8 else (16 if m <= 16 else (32 if m <= 32 else 64))
    tiles = [(128, bm, 128, 16, 4), (128, bm, 64, 16, 4), (64, bm, 128, 16, 4), (64, bm, 128, 16, 3),
             (64, bm, 64, 16, 5), (128, bm, 128, 16, 3), (256, bm, 64, 16, 3)]
    # 0.5 programs per SM: no split-K for the small products (one pass over K, no partials meeting)
    return [(t, w) for t in tiles for w in (0.5, 1.0, 2.0, 4.0)]


def bench_swap(n: int, k: int, ms, l2_bytes: int, replays: int, tiles: bool = True) -> list[dict]:
    """Decode sizes: cuBLAS bf16 vs the Triton kernels the dispatch used before (fused tl.dot; gemv at
    M = 1) vs the Gluon swap-AB kernel with its default tile and (tiles) the fastest of `swap_candidates`."""
    from qerl.kernels.gluon import nvfp4 as gk
    from qerl.kernels import route as rt
    from qerl.kernels.triton import fp4 as tk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fp4_bytes, copies, bf, q = rotated_weights(n, k, l2_bytes)
    rows = []
    for m in ms:
        xs, time = _decode_inputs(m, k, fp4_bytes, copies, replays)
        # the form the route picks here (on sm_90 the wgmma form from 9 rows, and 5-8 rows for the largest weights)
        wg = rt.route("nvfp4", m, n, k, torch.cuda.get_device_capability()) in (rt.GLUON_WGMMA, rt.GLUON_WGMMA_XP)
        t = {"cublas": time(lambda i: F.linear(xs[i % 2], bf[i % copies])),
             "fused": time(lambda i: tk.nvfp4_linear_triton(xs[i % 2], **q[i % copies])),
             "swap": time(lambda i: gk.nvfp4_linear_gluon(xs[i % 2], **q[i % copies], wgmma=wg))}
        if m == 1:
            t["gemv"] = time(lambda i: tk.nvfp4_linear_gemv(xs[i % 2], **q[i % copies]))
        if wg:  # time the mma.sync form too
            t["swap_mma_sync"] = time(lambda i: gk.nvfp4_linear_gluon(xs[i % 2], **q[i % copies]))
        # (config, waves, split) of the tiles whose K split exists
        cands = [(cfg, waves, split) for cfg, waves in (swap_candidates(m) if tiles else [])
                 for split in [gk.split_for(m, n, k, cfg, sms, waves)[0] if k % (2 * cfg[2]) == 0 else None]
                 if split is not None]
        best = _fastest((t["swap"], None), cands, lambda c: time(lambda i: gk.nvfp4_linear_gluon(
            xs[i % 2], **q[i % copies], config=c[0], split=c[2], wgmma=wg)), lambda c: f"{c[0]} waves {c[1]}")
        act, c = 2 * m * (n + k), best[1]
        rows.append({"N": n, "K": k, "M": m, **{f"t_{a}_us": v * 1e6 for a, v in t.items()},
                     "t_swap_best_us": best[0] * 1e6, "best_cfg": None if c is None else [*c[0], c[2]],
                     "x_swap": t["cublas"] / t["swap"], "x_swap_best": t["cublas"] / best[0],
                     "x_fused": t["cublas"] / t["fused"], "bw_swap": (fp4_bytes + act) / t["swap"],
                     "bw_cublas": (2 * n * k + act) / t["cublas"]})
    free_weights(bf, q)
    return rows


def _swap_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Device: {meta['device']}; date {meta['date']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"command `{meta['command']}`", "",
             md_header("model | layer (N x K) | M | cuBLAS bf16 us | fused tl.dot us | gemv us | swap mma.sync us (if "
                       "not the default) | swap us | swap best us (BN,BM,BKH,KW,NS,split) | x cuBLAS fused | x cuBLAS "
                       "swap | x cuBLAS swap best | swap TB/s | cuBLAS TB/s", "ll" + "r" * 12)]
    for r in rows:
        gemv = f"{r['t_gemv_us']:.1f}" if "t_gemv_us" in r else ""
        mma = f"{r['t_swap_mma_sync_us']:.1f}" if "t_swap_mma_sync_us" in r else ""
        lines.append(f"| {r['model']} | {r['layer']} {r['N']}x{r['K']} | {r['M']} | {r['t_cublas_us']:.1f} | "
                     f"{r['t_fused_us']:.1f} | {gemv} | {mma} | {r['t_swap_us']:.1f} | {r['t_swap_best_us']:.1f} "
                     f"{r['best_cfg']} | {r['x_fused']:.2f} | {r['x_swap']:.2f} | {r['x_swap_best']:.2f} | "
                     f"{r['bw_swap'] / 1e12:.2f} | {r['bw_cublas'] / 1e12:.2f} |")
    return "\n".join(lines) + "\n"


def _decode_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Device: {meta['device']}; date {meta['date']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"command `{meta['command']}`", "",
             md_header("model | layer (N x K) | M | cuBLAS bf16 us | fused tl.dot us | gemv us | gemv best us (cfg) | "
                       "x cuBLAS fused | x cuBLAS gemv | x cuBLAS gemv best | gemv best TB/s | cuBLAS TB/s",
                       "ll" + "r" * 10)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['layer']} {r['N']}x{r['K']} | {r['M']} | {r['t_cublas_us']:.1f} | "
                     f"{r['t_fused_us']:.1f} | {r['t_gemv_us']:.1f} | {r['t_gemv_best_us']:.1f} {r['best_cfg']} | "
                     f"{r['x_fused']:.2f} | {r['x_gemv']:.2f} | {r['x_gemv_best']:.2f} | "
                     f"{r['bw_gemv_best'] / 1e12:.2f} | {r['bw_cublas'] / 1e12:.2f} |")
    return "\n".join(lines) + "\n"


def _markdown(rows: list[dict], meta: dict) -> str:
    copy = meta["copy_bw"]
    lines = [f"Device: {meta['device']}; date {meta['date']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"copy bandwidth {copy / 1e12:.2f} TB/s; command `{meta['command']}`", "",
             md_header("model | layer | kind | M | cuBLAS bf16 us | deq+cuBLAS us | fused us | routed us | routed x "
                       "cuBLAS | routed x deq | fused x cuBLAS | fused x deq | fused TB/s (% copy) | cuBLAS TB/s | "
                       "fused TFLOP/s", "lll" + "r" * 12)]
    for r in rows:
        routed = (f"{r['t_routed_us']:.1f} | {r['routed_vs_cublas']:.2f} | {r['routed_vs_deq']:.2f}"
                  if "t_routed_us" in r else " | | ")
        lines.append(f"| {r['model']} | {r['layer']} {r['N']}x{r['K']} | {r['kind']} | {r['M']} | "
                     f"{r['t_cublas_us']:.1f} | {r['t_deq+cublas_us']:.1f} | {r['t_fused_us']:.1f} | {routed} | "
                     f"{r['speedup_vs_cublas']:.2f} | {r['speedup_vs_deq']:.2f} | "
                     f"{r['bw_fused'] / 1e12:.2f} ({100 * r['bw_fused'] / copy:.0f}%) | {r['bw_cublas'] / 1e12:.2f} | "
                     f"{r['tflops_fused']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qerl bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="7B,14B,32B,72B",
                   help=f"comma list of {','.join(MODEL_SHAPES)} (Qwen2.5 sizes, SmolLM2-135M)")
    p.add_argument("--layers", default="qkv,o,gate_up,down")
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma list of M (forward)")
    p.add_argument("--backward-m", default=",".join(map(str, BACKWARD_M)), help="comma list of M (dY @ W); '' for none")
    p.add_argument("--replays", type=int, default=15)
    p.add_argument("--decode", action="store_true",
                   help="decode sizes only (--m default 1,2,4,8,16): cuBLAS vs fused vs the CUDA-core gemv kernel")
    p.add_argument("--sweep", action="store_true", help="time candidate tiles on a few shapes instead")
    p.add_argument("--swap", action="store_true",
                   help="decode sizes (--m default 1..64): the Gluon swap-AB kernel, its tile sweep, vs cuBLAS/Triton")
    p.add_argument("--no-tile-sweep", action="store_true", help="with --swap: only the default tile")
    p.add_argument("--compute", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: cuBLAS bf16 vs W4A16, W8A8 (_scaled_mm) and the W4A8 kernels of model.compute fp8 "
                        "(--m default 1..8192; `qerl.bench.kernels_fp8`)")
    p.add_argument("--out", default="kernels_bench", help="output prefix: writes <out>.json and <out>.md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench kernels needs a CUDA GPU")
    import triton

    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    meta = {"device": props.name, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__,
            "command": " ".join(["qerl bench kernels", *(sys.argv[1:] if argv is None else argv)]),
            "copy_bw": copy_bandwidth(), "l2_bytes": l2}
    if (args.decode or args.swap) and args.m == ",".join(map(str, M_VALUES)):  # --decode wins over --swap
        args.m = ",".join(map(str, DECODE_M if args.decode else SWAP_M))
    if args.compute == "fp8":
        return _run_fp8(args, l2, meta)
    ms = [int(v) for v in args.m.split(",") if v]
    bms = [int(v) for v in args.backward_m.split(",") if v]
    if args.sweep:
        return _run_sweep(args, ms, bms, l2)
    if args.decode:
        cands = gemv_candidates()
        return _run_per_shape(args, meta, lambda n, k: bench_decode(n, k, ms, l2, args.replays, cands),
                              f"{args.out}_decode", _best_progress("gemv"), _decode_markdown)
    if args.swap:
        return _run_per_shape(args, meta, lambda n, k: bench_swap(n, k, ms, l2, args.replays, not args.no_tile_sweep),
                              f"{args.out}_swap", _best_progress("swap"), _swap_markdown)
    return _run_per_shape(args, meta, lambda n, k: bench_shape(n, k, ms, bms, l2, args.replays), args.out,
                          lambda r: f"{r['kind']} M={r['M']}: cublas {r['t_cublas_us']:.1f} deq "
                                    f"{r['t_deq+cublas_us']:.1f} fused {r['t_fused_us']:.1f} routed "
                                    f"{r['t_routed_us']:.1f} us routed x{r['routed_vs_cublas']:.2f}",
                          _markdown, partial=False)


def _shapes(args):
    """(model, layer, N, K) of every shape that --models x --layers selects, in order."""
    for model in args.models.split(","):
        for layer, (n, k) in layer_shapes(model).items():
            if layer in args.layers.split(","):
                yield model, layer, n, k


def _write(prefix: str, meta: dict, rows: list[dict], markdown=None) -> None:
    """<prefix>.json with the rows so far; given markdown(rows, meta), also <prefix>.md, printed."""
    with open(prefix + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if markdown is not None:
        md = markdown(rows, meta)
        with open(prefix + ".md", "w") as f:
            f.write(md)
        print(md)


def _run_per_shape(args, meta, bench, prefix: str, progress, markdown, partial: bool = True) -> int:
    """bench(n, k) -> rows for every selected layer shape, a progress line per row ("MODEL LAYER " +
    progress(row)); <prefix>.json rewritten after every row (partial), <prefix>.json and .md at the end."""
    rows = []
    for model, layer, n, k in _shapes(args):
        for r in bench(n, k):
            rows.append({"model": model, "layer": layer, **r})
            print(f"{model} {layer} {progress(r)}", flush=True)
            if partial:
                _write(prefix, meta, rows)
    _write(prefix, meta, rows, markdown)
    return 0


def _best_progress(kind: str):
    """The progress line of a `bench_decode` (kind "gemv") or `bench_swap` ("swap") row."""
    return lambda r: (f"M={r['M']}: cublas {r['t_cublas_us']:.1f} fused {r['t_fused_us']:.1f} {kind} "
                      f"{r[f't_{kind}_us']:.1f} best {r[f't_{kind}_best_us']:.1f} {r['best_cfg']} "
                      f"x{r[f'x_{kind}']:.2f} / best x{r[f'x_{kind}_best']:.2f}")


def _run_fp8(args, l2, meta) -> int:
    from .kernels_fp8 import FP8_M_VALUES, bench_fp8_shape, fp8_markdown, fp8_summary

    if torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("qerl bench kernels --compute fp8 needs FP8 tensor cores (compute capability 8.9+)")
    ms = FP8_M_VALUES if args.m == ",".join(map(str, M_VALUES)) else [int(v) for v in args.m.split(",") if v]
    return _run_per_shape(args, meta, lambda n, k: bench_fp8_shape(n, k, ms, l2, args.replays), f"{args.out}_fp8",
                          lambda r: f"M={r['M']}: cublas {r['t_cublas_us']:.1f} w4a16 {r['t_w4a16_us']:.1f} w8a8 "
                                    f"{r['t_w8a8_us']:.1f} w4a8 {r['t_w4a8_us']:.1f} routed {r['t_routed_fp8_us']:.1f}",
                          lambda rows, meta: fp8_markdown(rows, meta) + "\nMedian over the shapes, x cuBLAS bf16:\n\n"
                          + fp8_summary(rows))


def _run_sweep(args, ms, bms, l2) -> int:
    from qerl.kernels.triton.fp4_mm import TileConfig as T

    small = [T(16, 64, 128, 0), T(16, 32, 128, 0), T(16, 64, 128, 0, 8), T(16, 128, 128, 0, 8), T(16, 32, 256, 0, 8),
             T(16, 64, 128, 0, prefetch=False), T(16, 64, 128, 0, 4, 1), T(16, 128, 64, 0)]
    mid = [T(32, 64, 128, 0), T(64, 64, 128, 0), T(64, 64, 128, 0, 8), T(32, 128, 128, 0, 8), T(64, 128, 64, 0, 8),
           T(64, 32, 128, 0)]
    large = [T(128, 128, 64, 1, 8), T(128, 128, 64, 1, 8, prefetch=False), T(128, 256, 64, 1, 8),
             T(64, 128, 64, 1, 4), T(128, 128, 128, 1, 8), T(64, 256, 64, 1, 8)]
    out = []
    for model, layer, n, k in _shapes(args):
        for kind, mlist in (("forward", ms), ("grad_input", bms)):
            for m in mlist:
                cands = small if m <= 16 else (mid if m <= 64 else large)
                res = sweep(n, k, m, kind, cands, l2, args.replays)
                line = f"{model} {layer} {kind} M={m}: " + "; ".join(f"{t:.1f}us {c}" for t, c in res[:4])
                print(line, flush=True)
                out.append(line)
    with open(args.out + "_sweep.txt", "w") as f:
        f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
