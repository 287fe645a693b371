"""One mixture-of-experts layer's experts at decode and prefill sizes: NVFP4 experts through the grouped kernel
(`QuantExperts`' grouped path), NVFP4 through the reference loop (each hit expert dequantized per call), and
16-bit experts as transformers runs them (its eager loop, and `grouped_mm` where this transformers has it).
Random weights at a real shape (default Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert width 768),
uniform random routing, CUDA events around one experts call (median of --repeats after warm-up). The grouped
NVFP4 path has no host sync, so it is also timed replayed from a CUDA graph, as the rollout engine would run it:
that column is GPU time alone, without Python and launch overhead; the eager columns include them.

    python benchmarks/moe_layer.py --tokens 8,64,256,2048
"""

import argparse
import datetime

import torch

SHAPES = {"qwen3-30b-a3b": dict(num_experts=128, top_k=8, hidden=2048, inter=768)}


def experts_module(shape: dict, implementation: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"],
                         num_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"],
                         experts_implementation=implementation)
    with torch.device("cuda"):
        m = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def graphed(fn):
    """fn captured once in a CUDA graph (after a warm-up on a side stream); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv=None) -> int:
    from qerl.nn.quant_experts import QuantExperts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=tuple(SHAPES))
    ap.add_argument("--tokens", default="8,64,256,2048")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-reference", action="store_true", help="skip the slow per-expert dequantizing loop")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    bf16 = {"eager": experts_module(shape, "eager")}
    try:
        bf16["grouped_mm"] = experts_module(shape, "grouped_mm")
        bf16["grouped_mm"].load_state_dict(bf16["eager"].state_dict())
    except Exception as e:  # an older transformers: no such implementation
        print(f"bf16 grouped_mm unavailable: {type(e).__name__}: {e}")
    quant = QuantExperts.from_experts(bf16["eager"], "nvfp4")
    E, k, H = shape["num_experts"], shape["top_k"], shape["hidden"]
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(T)
        index = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device="cuda", generator=g, dtype=torch.bfloat16)
        x = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
        with torch.no_grad():
            row = {"tokens": T, "experts hit": int(index.unique().numel())}
            row["nvfp4 grouped ms"] = timed(lambda: quant(x, index, weights), args.repeats)
            row["nvfp4 grouped, CUDA graph ms"] = timed(graphed(lambda: quant(x, index, weights)), args.repeats)
            if not args.skip_reference:
                row["nvfp4 reference ms"] = timed(lambda: quant.reference_forward(x, index, weights), 5)
            for name, m in bf16.items():
                try:
                    row[f"bf16 {name} ms"] = timed(lambda: m(x, index, weights), args.repeats)
                except Exception as e:  # an implementation this transformers / torch cannot run here
                    print(f"bf16 {name}: {type(e).__name__}: {e}")
                if name == "grouped_mm":
                    try:  # capturable only if this transformers' grouped path never syncs with the host
                        row["bf16 grouped_mm, CUDA graph ms"] = timed(graphed(lambda: m(x, index, weights)),
                                                                      args.repeats)
                    except Exception as e:
                        print(f"bf16 grouped_mm in a CUDA graph: {type(e).__name__}: {str(e)[:200]}")
            want = bf16["eager"](x, index, weights).float()
            got = quant(x, index, weights).float()
            row["rel diff vs bf16 (4-bit error)"] = float((got - want).norm() / want.norm())
        rows.append(row)
        print(row, flush=True)
    cols = list(rows[0])
    print(f"\n{torch.cuda.get_device_name()}; {datetime.date.today()}; {args.shape} {shape}; median of "
          f"{args.repeats} calls (reference: 5)")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r.get(c, float('nan')):.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
