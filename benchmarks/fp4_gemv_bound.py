"""What bounds the NVFP4 decode product at 1-16 rows: the weights streamed from DRAM, the same weights re-read from
L2, and the smallest launch, for the Gluon swap-AB kernel the decode routes to; plus the kernel's K loop in SASS.

    python benchmarks/fp4_gemv_bound.py --model 7B --rows 1,8 [--sass]
    python benchmarks/fp4_gemv_bound.py --sass --rows 1,8,16   # no GPU needed: the loop's instruction count

Per (layer, rows): us per call and GB/s with the weights rotated through more than 2x L2 (what a decode step sees),
the same call on one weight that stays in L2 (only where it fits in a quarter of L2: a partition's share), and the
ratio. A ratio near 1 says the kernel is not waiting on DRAM (its instructions, latency chain or launch bound it);
a ratio well above 1 says DRAM is the limit. "tiny" is a 64 x 256 weight: the fixed cost of one launch in a CUDA
graph (its ramp, the split-K arrival and store). Times: CUDA-graph replays of many calls, median (bench.graph_timing).
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch

from qerl.bench.graph_timing import copy_bandwidth, graph_time, rotated_copies
from qerl.bench.kernels import layer_shapes


# "/*0070*/ @P0 IMAD.MOV.U32 R1, RZ, RZ, R2 ;": address, opcode, operands
SASS_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")


def fp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16


def time_call(n: int, k: int, m: int, copies: int, calls: int, replays: int = 7, split: int | None = None) -> float:
    """Seconds per call of the routed swap-AB product over `copies` rotated weights (split: K splits instead of
    the launcher's choice)."""
    from qerl.kernels.gluon import nvfp4 as gk
    from qerl.kernels import route as rt

    from qerl.formats.nvfp4 import quantize_nvfp4

    q = [quantize_nvfp4(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    wg = rt.route("nvfp4", m, n, k, torch.cuda.get_device_capability()) in (rt.GLUON_WGMMA, rt.GLUON_WGMMA_XP)
    t = graph_time(lambda i: gk.nvfp4_linear_gluon(xs[i % 2], **q[i % copies], wgmma=wg, split=split), calls,
                   replays)
    q.clear()
    torch.cuda.empty_cache()
    return t


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest backward branch's body in cuobjdump/nvdisasm SASS text: a decode kernel's K loop."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in SASS_INS.finditer(sass)]
    loops = [(addr - int(t.group(1), 16), int(t.group(1), 16), addr) for addr, op, rest in ins if op == "BRA"
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < addr]
    if not loops:
        return []
    _, lo, hi = max(loops)
    return [op for addr, op, _ in ins if lo <= addr <= hi]


def offline_sass(m: int, n: int, k: int, capability: tuple[int, int] = (9, 0)) -> tuple[str, int, str]:
    """(kernel form, weights per thread per loop iteration, SASS) of the swap-AB kernel the route picks for an
    [m, k] x [n, k]^T product on a GPU of `capability`, compiled here for that target by Triton's own ptxas: no GPU
    is needed, so an instruction count can be read on any machine (the CUDA stack a GPU runs may differ a little).
    The constants are the launcher's (`pick_config`, split > 1, PDL on from sm_90)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from qerl.kernels import route as rt
    from qerl.kernels.gluon import nvfp4 as gk

    form = rt.route("nvfp4", m, n, k, capability)
    wgmma = form in (rt.GLUON_WGMMA, rt.GLUON_WGMMA_XP)
    if wgmma:
        from qerl.kernels.gluon.nvfp4_wgmma import nvfp4_swap_wgmma_kernel as kernel
        cfg, _ = gk.pick_config_wgmma(m, n, k)
    elif form == rt.GLUON_MMA:
        kernel = gk.nvfp4_swap_kernel
        cfg, _ = gk.pick_config(m, n, k)
    else:
        raise ValueError(f"{m} x {n} x {k} routes to {form}, not a swap-AB kernel")
    bn, bm, bkh, kw, ns = cfg
    const = dict(BN=bn, BM=bm, BKH=bkh, KW=kw, NS=ns, PARTIAL=True, NW=4, SALIGN=16, HAS_BIAS=False, RP=0,
                 PDL=capability >= (9, 0))
    const.update({"XP": form == rt.GLUON_WGMMA_XP} if wgmma else {"E4M3_CVT": capability >= (8, 9)})
    ints = ("M", "N", "K", "stride_xm", "stride_w", "stride_s", "stride_om", "tiles_per_split", "stride_hm", "R")
    dtypes = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "gs_ptr": "*fp32", "b_ptr": "*bf16",
              "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "h_ptr": "*bf16", "lb_ptr": "*bf16"}
    names = kernel.arg_names
    sig = {a: dtypes.get(a, "i32" if a in ints else "constexpr") for a in names}
    # pointers and the sizes/strides a decode launch has are multiples of 16 (what Triton specializes on)
    aligned = [a for a in names if a in dtypes or a in ("N", "K", "stride_xm", "stride_w", "stride_s", "stride_om")]
    src = GluonASTSource(kernel, sig, {(names.index(a),): v for a, v in const.items()},
                         {(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                              options={"num_warps": 4})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool if os.path.exists(tool) else "cuobjdump", "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    return form, bn * 2 * bkh // (4 * 32), sass  # a stage's BN x 2 BKH weights over the 4 warps' threads


def sass_table(rows: list[int], n: int, k: int) -> str:
    """Per row count: the kernel form, its K loop's instructions per weight and opcode mix (sm_90 SASS)."""
    out = ["| rows | kernel | loop instructions | weights per thread | instructions per weight | opcode mix |",
           "|---:|---|---:|---:|---:|---|"]
    for m in rows:
        form, weights, sass = offline_sass(m, n, k)
        ops = collections.Counter(op.split(".")[0] for op in main_loop(sass))
        total = sum(ops.values())
        mix = ", ".join(f"{op} {c}" for op, c in ops.most_common(12))
        out.append(f"| {m} | {form} | {total} | {weights} | {total / weights:.2f} | {mix} |")
    return "\n".join(out)


def _calls(b: int, l2: int, bw: float) -> tuple[int, int]:
    """(rotated copies, calls per graph) for a product of b bytes: copies spanning 2x L2, ~3 ms of calls (up to 200,
    so that the smallest launch's fixed cost is timed over many calls)."""
    copies = rotated_copies(b, l2)
    calls = max(copies, min(200, int(3e-3 * bw // max(b, 1))))
    return copies, calls - calls % copies


def split_table(shapes: dict, rows: list[int], splits: list[int], l2: int, bw: float) -> None:
    """Prints us per call of each product at each K split count (the launcher's tile and kernel form), and at the
    launcher's own split."""
    from qerl.kernels import route as rt
    from qerl.kernels.gluon import nvfp4 as gk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| layer | N x K | rows | " + " | ".join(f"split {v} us" for v in splits) + " | launcher's split | us | "
          "best / launcher's |")
    print("|---|---|---:|" + "---:|" * (len(splits) + 3))
    for m in rows:
        for name, (n, k) in shapes.items():
            b = fp4_bytes(n, k)
            copies, calls = _calls(b, l2, bw)
            wg = rt.route("nvfp4", m, n, k, torch.cuda.get_device_capability()) in (rt.GLUON_WGMMA, rt.GLUON_WGMMA_XP)
            cfg, waves = (gk.pick_config_wgmma if wg else gk.pick_config)(m, n, k)
            own = gk.split_for(m, n, k, cfg, sms, waves)[0]
            times = [time_call(n, k, m, copies, calls, split=v) for v in splits]
            t_own = time_call(n, k, m, copies, calls)
            cells = " | ".join(f"{t * 1e6:.2f}" for t in times)
            print(f"| {name} | {n} x {k} | {m} | {cells} | {own} | {t_own * 1e6:.2f} | {min(times) / t_own:.2f} |",
                  flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7B", help="1.5B, 3B, 7B, 14B, 32B, 72B or SmolLM2")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--splits", default="",
                    help="comma list of K split counts: time each model product at each instead (DRAM-rotated)")
    ap.add_argument("--sass", action="store_true",
                    help="also print the K loop's instruction mix per row count (sm_90 SASS compiled here: no GPU "
                         "needed; with no GPU only this table is printed)")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = layer_shapes(args.model)
    if not torch.cuda.is_available():
        if not args.sass:
            ap.error("needs a CUDA GPU (the Gluon kernels it times run on sm_80 and newer); --sass alone runs "
                     "without one")
        n, k = next(v for name, v in shapes.items() if "q" in name)
        print(f"K loop of the q/k/v product ({n} x {k}), sm_90:")
        print(sass_table(rows, n, k))
        return 0
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    bw = copy_bandwidth()
    print(f"device: {props.name}, L2 {l2 / 2**20:.0f} MiB, copy bandwidth {bw / 1e12:.2f} TB/s")
    if args.splits:
        split_table(shapes, rows, [int(v) for v in args.splits.split(",")], l2, bw)
        return 0
    # slices of the two large products that fit a partition's share of L2 (the grid shrinks with N; K stays)
    gate_up_n, gate_up_k = next(v for name, v in shapes.items() if "gate" in name)
    down_n = next(v for name, v in shapes.items() if "down" in name)[0]
    shapes = {**shapes, "gate/up, 4096 rows": (4096, gate_up_k), "down, K 4608": (down_n, 4608), "tiny": (64, 256)}
    print("| layer | N x K | rows | DRAM us | DRAM GB/s | % copy bw | L2 us | L2 GB/s | DRAM / L2 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        for name, (n, k) in shapes.items():
            b = fp4_bytes(n, k)
            copies, calls = _calls(b, l2, bw)
            t_dram = time_call(n, k, m, copies, calls)
            t_l2 = time_call(n, k, m, 1, max(20, calls)) if b <= l2 // 4 else None
            l2_cols = (f"{t_l2 * 1e6:.2f} | {b / t_l2 / 1e9:.0f} | {t_dram / t_l2:.2f}" if t_l2 else "- | - | -")
            print(f"| {name} | {n} x {k} | {m} | {t_dram * 1e6:.2f} | {b / t_dram / 1e9:.0f} | "
                  f"{100 * b / t_dram / bw:.0f} | {l2_cols} |", flush=True)
    if args.sass:
        n, k = next(v for name, v in shapes.items() if "q" in name)
        print(f"K loop of the q/k/v product ({n} x {k}), sm_90 SASS compiled on this machine:")
        print(sass_table(rows, n, k))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
