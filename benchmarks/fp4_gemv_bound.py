"""What bounds the NVFP4 decode product at 1-16 rows: the weights streamed from DRAM, the same weights re-read from
L2, and the smallest launch, for the Gluon swap-AB kernel the decode routes to; plus the kernel's SASS opcode mix.

    python benchmarks/fp4_gemv_bound.py --model 7B --rows 1,8 [--sass]

Per (layer, rows): us per call and GB/s with the weights rotated through more than 2x L2 (what a decode step sees),
the same call on one weight that stays in L2 (only where it fits in a quarter of L2: a partition's share), and the
ratio. A ratio near 1 says the kernel is not waiting on DRAM (its instructions, latency chain or launch bound it);
a ratio well above 1 says DRAM is the limit. "tiny" is a 64 x 256 weight: the fixed cost of one launch in a CUDA
graph (its ramp, the split-K arrival and store). Times: CUDA-graph replays of many calls, median (bench.graph_timing).
"""

import argparse
import collections
import re
import subprocess
import tempfile

import torch

from qerl.bench.graph_timing import copy_bandwidth, graph_time
from qerl.bench.kernels import _weights, layer_shapes


SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]+)")  # "/*0070*/ @P0 IMAD.MOV ..."


def fp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16


def time_call(n: int, k: int, m: int, copies: int, calls: int, replays: int = 7) -> float:
    """Seconds per call of the routed swap-AB product over `copies` rotated weights."""
    from qerl.kernels.gluon import nvfp4 as gk
    from qerl.kernels import route as rt

    _, q = _weights(n, k, copies)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    wg = rt.route("nvfp4", m, n, k, torch.cuda.get_device_capability()) in (rt.GLUON_WGMMA, rt.GLUON_WGMMA_XP)
    t = graph_time(lambda i: gk.nvfp4_linear_gluon(xs[i % 2], **q[i % copies], wgmma=wg), calls, replays)
    q.clear()
    torch.cuda.empty_cache()
    return t


def sass_mix(top: int = 18) -> str:
    """Opcode counts of every compiled nvfp4_swap_kernel (static code, so the loop body dominates)."""
    from qerl.kernels.gluon.nvfp4 import nvfp4_swap_kernel

    lines = []
    for cache in getattr(nvfp4_swap_kernel, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for key, compiled in kernels.items():
            cubin = compiled.asm.get("cubin")
            if cubin is None:
                continue
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                try:
                    sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
                except FileNotFoundError:
                    sass = subprocess.run(["nvdisasm", f.name], capture_output=True, text=True).stdout
            ops = collections.Counter(m.group(1).split(".")[0] for m in SASS_OP.finditer(sass))
            meta = compiled.metadata
            cfg = {k: v for k, v in getattr(meta, "constants", {}).items()} if hasattr(meta, "constants") else ""
            lines.append(f"kernel {str(key)[:160]} {cfg}: {sum(ops.values())} instructions; "
                         + ", ".join(f"{op} {c}" for op, c in ops.most_common(top)))
    return "\n".join(lines) or "no compiled kernel found"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7B", help="1.5B, 3B, 7B, 14B, 32B, 72B or SmolLM2")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--sass", action="store_true", help="print the opcode mix of the compiled kernels")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Gluon kernels it times run on sm_80 and newer)")
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    bw = copy_bandwidth()
    print(f"device: {props.name}, L2 {l2 / 2**20:.0f} MiB, copy bandwidth {bw / 1e12:.2f} TB/s")
    shapes = layer_shapes(args.model)
    # slices of the two large products that fit a partition's share of L2 (the grid shrinks with N; K stays)
    gate_up_n, gate_up_k = next(v for name, v in shapes.items() if "gate" in name)
    down_n = next(v for name, v in shapes.items() if "down" in name)[0]
    shapes = {**shapes, "gate/up, 4096 rows": (4096, gate_up_k), "down, K 4608": (down_n, 4608), "tiny": (64, 256)}
    print("| layer | N x K | rows | DRAM us | DRAM GB/s | % copy bw | L2 us | L2 GB/s | DRAM / L2 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in shapes.items():
            b = fp4_bytes(n, k)
            copies = min(16, max(1, -(-2 * l2 // b)))
            calls = max(copies, min(200, int(3e-3 * bw // max(b, 1))))
            calls -= calls % copies
            t_dram = time_call(n, k, m, copies, calls)
            t_l2 = time_call(n, k, m, 1, max(20, calls)) if b <= l2 // 4 else None
            l2_cols = (f"{t_l2 * 1e6:.2f} | {b / t_l2 / 1e9:.0f} | {t_dram / t_l2:.2f}" if t_l2 else "- | - | -")
            print(f"| {name} | {n} x {k} | {m} | {t_dram * 1e6:.2f} | {b / t_dram / 1e9:.0f} | "
                  f"{100 * b / t_dram / bw:.0f} | {l2_cols} |", flush=True)
    if args.sass:
        print(sass_mix())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
