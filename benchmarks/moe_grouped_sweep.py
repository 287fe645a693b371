"""Tile sweep of the grouped FP4 experts kernel (`kernels.triton.fp4_grouped`) at decode and prefill sizes of a
real MoE shape: for each (BN, BK, warps, stages) the gate_up and down products alone (routing precomputed,
replayed from a CUDA graph, median of --repeats), checked against the default tiles' output, and the bytes each
reads as effective bandwidth. Prints one table per token count, fastest first.

    python benchmarks/moe_grouped_sweep.py --tokens 8,64,256
"""

import argparse
import datetime
import itertools

import torch


def main(argv=None) -> int:
    from qerl.formats import get_format
    from qerl.kernels.triton import fp4_grouped as grouped

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8,64,256")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--bn", default="32,64,128")
    ap.add_argument("--bk", default="64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    E, H, I = args.experts, args.hidden, args.inter
    fmt = get_format("nvfp4")
    torch.manual_seed(0)

    def stack(n, k):
        per = [fmt.quantize(torch.randn(n, k, device="cuda") * 0.02) for _ in range(E)]
        return {name: torch.stack([t[name] for t in per]) for name in per[0]}

    weights = {"gate_up": stack(2 * I, H), "down": stack(H, I)}
    default = (grouped.BN, grouped.BK, grouped.NUM_WARPS, grouped.NUM_STAGES)

    def run(x, offsets, w):
        return grouped.grouped_fp4_linear(x, offsets, w["weight_packed"], w["weight_scale"],
                                          w["weight_global_scale"], 16, False)

    def graph_time(fn):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(3):
            g.replay()
        times = []
        for _ in range(args.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    print(f"{torch.cuda.get_device_name()}; {datetime.date.today()}; E {E} top-{args.top_k} H {H} I {I}; nvfp4; "
          f"default tiles BN,BK,warps,stages = {default}")
    for T in [int(t) for t in args.tokens.split(",")]:
        index = torch.rand(T, E, device="cuda").topk(args.top_k, dim=-1).indices.reshape(-1)
        counts = torch.bincount(index, minlength=E)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        hit = int((counts > 0).sum())
        inputs = {"gate_up": torch.randn(T * args.top_k, H, device="cuda", dtype=torch.bfloat16),
                  "down": torch.randn(T * args.top_k, I, device="cuda", dtype=torch.bfloat16)}
        nbytes = {name: hit * w["weight_packed"][0].numel() * (1 + 1 / 8) for name, w in weights.items()}
        grouped.BN, grouped.BK, grouped.NUM_WARPS, grouped.NUM_STAGES = default
        ref = {name: run(inputs[name], offsets, w).float() for name, w in weights.items()}
        rows = []
        for bn, bk, warps, stages in itertools.product(*[[int(v) for v in a.split(",")] for a in
                                                         (args.bn, args.bk, args.warps, args.stages)]):
            grouped.BN, grouped.BK, grouped.NUM_WARPS, grouped.NUM_STAGES = bn, bk, warps, stages
            row = {"BN": bn, "BK": bk, "warps": warps, "stages": stages}
            try:
                total = 0.0
                for name, w in weights.items():
                    x = inputs[name]
                    got = run(x, offsets, w).float()
                    err = float((got - ref[name]).norm() / ref[name].norm())
                    if not err < 1e-2:
                        raise AssertionError(f"{name}: rel err {err:.3g} vs the default tiles")
                    ms = graph_time(lambda: run(x, offsets, w))
                    row[f"{name} us"] = ms * 1e3
                    row[f"{name} TB/s"] = nbytes[name] / ms / 1e9
                    total += ms
                row["total us"] = total * 1e3
            except Exception as e:  # a tile the compiler or the shapes refuse
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
            rows.append(row)
        grouped.BN, grouped.BK, grouped.NUM_WARPS, grouped.NUM_STAGES = default
        ok = sorted([r for r in rows if "error" not in r], key=lambda r: r["total us"])
        print(f"\ntokens {T}: {T * args.top_k} rows over {hit} experts; weight bytes read gate_up "
              f"{nbytes['gate_up'] / 1e6:.1f} MB, down {nbytes['down'] / 1e6:.1f} MB")
        print("| BN | BK | warps | stages | gate_up us | TB/s | down us | TB/s | total us |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in ok:
            mark = " (default)" if (r["BN"], r["BK"], r["warps"], r["stages"]) == default else ""
            print(f"| {r['BN']} | {r['BK']} | {r['warps']} | {r['stages']}{mark} | {r['gate_up us']:.1f} | "
                  f"{r['gate_up TB/s']:.2f} | {r['down us']:.1f} | {r['down TB/s']:.2f} | {r['total us']:.1f} |")
        for r in rows:
            if "error" in r:
                print(f"refused: BN {r['BN']} BK {r['BK']} warps {r['warps']} stages {r['stages']}: {r['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
