"""`qerl bench kernels --compute fp8`: the products of model.compute fp8 and model.format fp8 beside cuBLAS bf16.

For each layer shape and M, side by side on one GPU (timed as `qerl.bench.kernels` times: CUDA-graph replays
cycling weight copies that exceed twice the L2 cache, medians):
  cuBLAS bf16       F.linear on a bf16 weight;
  W4A16             what `nvfp4_linear` routes an NVFP4 weight to today (model.compute bf16);
  W8A8 _scaled_mm   an fp8 weight (model.format fp8): x quantized per token, torch._scaled_mm with row scales;
  W4A8 fused        the Triton kernel decoding NVFP4 to e4m3 in registers (`qerl.kernels.triton.w4a8`), x quantized
                    per token included, with its default tile and with the fastest of `W4A8_TILES`;
  W4A8 deq+_scaled_mm  the NVFP4 weight decoded to an e4m3 temporary, then _scaled_mm;
  routed fp8        what a model's layer gets under model.compute fp8 (`qerl.kernels.dispatch`).
Speedups are cuBLAS bf16's time over each. TFLOP/s counts 2 M N K per product.
"""

import statistics

import torch
import torch.nn.functional as F

# (BM, BN, BK, warps, stages) tried for the fused W4A8 kernel; the first is its default
W4A8_TILES = ((128, 128, 128, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 128, 4, 3),
              (128, 64, 128, 4, 3), (64, 64, 128, 4, 4))
FP8_M_VALUES = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _tile_candidates(m: int):
    return W4A8_TILES if m >= 64 else W4A8_TILES[3:]


def bench_fp8_shape(n: int, k: int, ms, l2_bytes: int, replays: int, sweep: bool = True) -> list[dict]:
    """Rows of microseconds per product for one [N, K] weight (see the module docstring)."""
    from qerl.formats.fp8 import quantize_fp8
    from qerl.formats.nvfp4 import quantize_nvfp4
    from qerl.kernels import quantized_linear
    from qerl.kernels.fp8_matmul import fp8_linear, w4a8_shift
    from qerl.kernels.nvfp4_matmul import nvfp4_linear
    from qerl.kernels.operands import scale_bytes
    from qerl.kernels.route import kernel_policy
    from qerl.kernels.triton import w4a8 as tk

    from .kernels import _graph_time

    fp4_bytes = n * k // 2 + n * k // 16
    copies = min(16, max(1, -(-2 * l2_bytes // fp4_bytes)))
    bf, q, f8 = [], [], []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        bf.append(w)
        q.append(quantize_nvfp4(w))
        f8.append(quantize_fp8(w))
    shifts = [w4a8_shift("nvfp4", t) for t in q]
    raw = [(t["weight_packed"], scale_bytes(t["weight_scale"])) for t in q]

    def fused(tile):
        def fn(i):
            x = xs[i % 2]
            xq, s = tk.quantize_rows_e4m3(x)
            (p, sc), (shift, ws) = raw[i % copies], shifts[i % copies]
            return tk.w4a8_linear(xq, s, p, sc, shift, ws, None, False, x.dtype, tile=tile)
        return fn

    def deq_scaled_mm(i):
        x = xs[i % 2]
        xq, s = tk.quantize_rows_e4m3(x)
        (p, sc), (shift, ws) = raw[i % copies], shifts[i % copies]
        w = tk.fp4_to_e4m3(p, sc, shift, False)
        return torch._scaled_mm(xq, w.t(), scale_a=s, scale_b=ws.reshape(1, -1), out_dtype=x.dtype)

    def routed_fp8(i):
        with kernel_policy(compute="fp8"):
            return quantized_linear("nvfp4", xs[i % 2], q[i % copies])

    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        calls = copies * max(1, min(8, int(2e-3 * 3e12 // (fp4_bytes * copies))))
        fns = {
            "cublas": lambda i: F.linear(xs[i % 2], bf[i % copies]),
            "w4a16": lambda i: nvfp4_linear(xs[i % 2], **q[i % copies]),
            "w8a8": lambda i: fp8_linear(xs[i % 2], **f8[i % copies]),
            "w4a8": fused(W4A8_TILES[0] if m >= 64 else W4A8_TILES[3]),
            "w4a8_deq": deq_scaled_mm,
            "routed_fp8": routed_fp8,
        }
        t = {name: _graph_time(fn, calls, replays) for name, fn in fns.items()}
        best_tile, best = None, t["w4a8"]
        if sweep:
            for tile in _tile_candidates(m):
                try:
                    tt = _graph_time(fused(tile), calls, replays)
                except Exception as e:  # a tile this GPU cannot build (shared memory, registers): skip it
                    print(f"  tile {tile}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                if tt < best:
                    best_tile, best = tile, tt
        t["w4a8_best"] = best
        row = {"N": n, "K": k, "M": m, **{f"t_{a}_us": v * 1e6 for a, v in t.items()},
               "best_tile": list(best_tile) if best_tile else None,
               **{f"x_{a}": t["cublas"] / v for a, v in t.items() if a != "cublas"},
               "tflops_w4a8_best": 2 * m * n * k / best / 1e12, "tflops_cublas": 2 * m * n * k / t["cublas"] / 1e12}
        rows.append(row)
    del bf, q, f8
    torch.cuda.empty_cache()
    return rows


def fp8_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Device: {meta['device']}; date {meta['date']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"command `{meta['command']}`. Microseconds per product; xN = cuBLAS bf16 time / this time.", "",
             "| model | layer | M | cuBLAS bf16 | W4A16 | W8A8 _scaled_mm | W4A8 fused | W4A8 best tile | "
             "W4A8 deq+_scaled_mm | routed fp8 | TFLOP/s bf16 / W4A8 best |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def cell(a):
            return f"{r[f't_{a}_us']:.1f} (x{r[f'x_{a}']:.2f})"
        tile = "x".join(map(str, r["best_tile"][:3])) if r["best_tile"] else "default"
        lines.append(f"| {r['model']} | {r['layer']} {r['N']}x{r['K']} | {r['M']} | {r['t_cublas_us']:.1f} | "
                     f"{cell('w4a16')} | {cell('w8a8')} | {cell('w4a8')} | {cell('w4a8_best')} {tile} | "
                     f"{cell('w4a8_deq')} | {cell('routed_fp8')} | "
                     f"{r['tflops_cublas']:.0f} / {r['tflops_w4a8_best']:.0f} |")
    return "\n".join(lines) + "\n"


def fp8_summary(rows: list[dict]) -> str:
    """Median speedups over cuBLAS bf16 per M across the shapes: the line a routing threshold is read from."""
    out = ["M | W4A16 | W8A8 | W4A8 fused | W4A8 best | W4A8 deq+_scaled_mm | routed fp8"]
    for m in sorted({r["M"] for r in rows}):
        sel = [r for r in rows if r["M"] == m]
        med = {a: statistics.median(r[f"x_{a}"] for r in sel)
               for a in ("w4a16", "w8a8", "w4a8", "w4a8_best", "w4a8_deq", "routed_fp8")}
        out.append(f"{m} | " + " | ".join(f"{v:.2f}" for v in med.values()))
    return "\n".join(out) + "\n"
