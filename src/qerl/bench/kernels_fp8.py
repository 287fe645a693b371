"""`qerl bench kernels --compute fp8`: the products of model.compute fp8 and model.format fp8 beside cuBLAS bf16
(cuBLAS bf16, W4A16, W8A8, W4A8, routed fp8), timed as `qerl.bench.kernels` times; the columns: docs/cli.md
("qerl bench kernels --compute fp8").
"""

import statistics

import torch
import torch.nn.functional as F

from .options import md_header

FP8_M_VALUES = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
COLUMNS = ("w4a16", "w8a8", "w4a8", "routed_fp8")


def bench_fp8_shape(n: int, k: int, ms, l2_bytes: int, replays: int) -> list[dict]:
    """Rows of microseconds per product (and x cuBLAS bf16, TFLOP/s: 2 M N K) for one [N, K] weight."""
    from qerl.formats.fp8 import quantize_fp8
    from qerl.kernels import quantized_linear
    from qerl.kernels.fp8_matmul import fp8_linear, w4a8_linear
    from qerl.kernels.nvfp4_matmul import nvfp4_linear
    from qerl.kernels.route import kernel_policy

    from .graph_timing import calls_per_graph, free_weights, graph_time, rotated_weights

    fp4_bytes, copies, bf, q = rotated_weights(n, k, l2_bytes)
    f8 = [quantize_fp8(w) for w in bf]

    def routed_fp8(i):
        with kernel_policy(compute="fp8"):
            return quantized_linear("nvfp4", xs[i % 2], q[i % copies])

    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        calls = calls_per_graph(fp4_bytes, copies)
        fns = {
            "cublas": lambda i: F.linear(xs[i % 2], bf[i % copies]),
            "w4a16": lambda i: nvfp4_linear(xs[i % 2], **q[i % copies]),
            "w8a8": lambda i: fp8_linear(xs[i % 2], **f8[i % copies]),
            "w4a8": lambda i: w4a8_linear("nvfp4", xs[i % 2], q[i % copies]),
            "routed_fp8": routed_fp8,
        }
        t = {name: graph_time(fn, calls, replays) for name, fn in fns.items()}
        rows.append({"N": n, "K": k, "M": m, **{f"t_{a}_us": v * 1e6 for a, v in t.items()},
                     **{f"x_{a}": t["cublas"] / t[a] for a in COLUMNS},
                     "tflops_cublas": 2 * m * n * k / t["cublas"] / 1e12,
                     "tflops_w4a8": 2 * m * n * k / t["w4a8"] / 1e12})
    free_weights(bf, q, f8)
    return rows


def fp8_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Device: {meta['device']}; date {meta['date']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"command `{meta['command']}`. Microseconds per product; xN = cuBLAS bf16 time / this time.", "",
             md_header("model | layer | M | cuBLAS bf16 | W4A16 | W8A8 | W4A8 | routed fp8 | TFLOP/s bf16 / W4A8",
                       "ll" + "r" * 7)]
    for r in rows:
        cells = " | ".join(f"{r[f't_{a}_us']:.1f} (x{r[f'x_{a}']:.2f})" for a in COLUMNS)
        lines.append(f"| {r['model']} | {r['layer']} {r['N']}x{r['K']} | {r['M']} | {r['t_cublas_us']:.1f} | {cells} | "
                     f"{r['tflops_cublas']:.0f} / {r['tflops_w4a8']:.0f} |")
    return "\n".join(lines) + "\n"


def fp8_summary(rows: list[dict]) -> str:
    """Median speedups over cuBLAS bf16 per M across the shapes: the table a routing threshold is read from."""
    out = [md_header("M | W4A16 | W8A8 | W4A8 | routed fp8", "rrrrr")]
    for m in sorted({r["M"] for r in rows}):
        sel = [r for r in rows if r["M"] == m]
        out.append(f"| {m} | " + " | ".join(f"{statistics.median(r[f'x_{a}'] for r in sel):.2f}" for a in COLUMNS)
                   + " |")
    return "\n".join(out) + "\n"
