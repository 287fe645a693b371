"""One mixture-of-experts layer's experts at decode and prefill sizes: NVFP4 experts through the grouped kernel
(`QuantExperts`' grouped path), NVFP4 through the reference loop (each hit expert dequantized per call), and
16-bit experts as transformers runs them (its eager loop, and `grouped_mm` where this transformers has it).
Random weights at a real shape (default Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert width 768),
uniform random routing, CUDA events around one experts call (median of --repeats after warm-up). The grouped
NVFP4 path has no host sync, so it is also timed replayed from a CUDA graph, as the rollout engine would run it:
that column is GPU time alone, without Python and launch overhead; the eager columns include them.
--gemv adds, in CUDA graphs, the layer with the grouped forward forced onto each kernel (the CUDA-core decode kernel
of `triton.fp4_grouped_gemv` and the tile kernel of `triton.fp4_grouped`; the default column uses the automatic
rule), their speed-up over bf16 grouped_mm, and the gate_up + down products alone per kernel with the weight bytes
of the hit experts as effective bandwidth. --gemv-config sets the decode kernel's `GroupedGemvConfig` fields.

    python benchmarks/moe_layer.py --tokens 8,64,256,2048
    python benchmarks/moe_layer.py --tokens 8,64,256 --gemv --skip-reference
"""

import argparse
import datetime

import torch

from qerl.bench.graph_timing import event_ms
from qerl.models.shapes import MOE_SHAPES

SHAPES = {name: dict(num_experts=s["num_experts"], top_k=s["num_experts_per_tok"], hidden=s["hidden_size"],
                     inter=s["moe_intermediate_size"])
          for name, s in MOE_SHAPES.items() if "num_experts" in s}  # the Qwen3-MoE shapes


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
    """Median ms of fn() by CUDA events, after 3 untimed calls."""
    return event_ms(fn, repeats, warmups=3)


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


def forced_kernels(row: dict, quant, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                   repeats: int) -> None:
    """Adds to row, for the grouped forward's decode kernel and tile kernel each (`triton.fp4_grouped.GEMV`
    forced while capturing): the layer replayed from a CUDA graph, and its two grouped products alone (the
    layer's sorted rows and offsets precomputed) with their hit experts' packed + scale bytes as TB/s."""
    from qerl.kernels.triton import fp4_grouped as grouped

    E = quant.num_experts
    flat = index.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    hit = int((counts > 0).sum())
    rows = flat.numel()
    inputs = {"gate_up_proj": torch.randn(rows, quant.hidden_dim, device=x.device, dtype=x.dtype),
              "down_proj": torch.randn(rows, quant.intermediate_dim, device=x.device, dtype=x.dtype)}
    nbytes = sum(hit * (getattr(quant, f"{w}_weight_packed")[0].numel()
                        + getattr(quant, f"{w}_weight_scale")[0].numel()) for w in inputs)

    def products():
        for w, a in inputs.items():
            quant._kernel_linear(a, offsets, w)

    saved = grouped.GEMV
    try:
        for kernel, force in (("gemv", True), ("tile", False)):
            grouped.GEMV = force
            row[f"nvfp4 {kernel}, CUDA graph ms"] = timed(graphed(lambda: quant(x, index, weights)), repeats)
            ms = timed(graphed(products), repeats)
            row[f"{kernel} products ms"] = ms
            row[f"{kernel} products TB/s"] = nbytes / ms / 1e9
    finally:
        grouped.GEMV = saved


def main(argv=None) -> int:
    from qerl.nn.quant_experts import QuantExperts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=tuple(SHAPES))
    ap.add_argument("--tokens", default="8,64,256,2048")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-reference", action="store_true", help="skip the slow per-expert dequantizing loop")
    ap.add_argument("--gemv", action="store_true", help="also time the grouped forward forced onto each FP4 kernel")
    ap.add_argument("--gemv-config", default="", help="decode kernel config, e.g. bn=256,warps=4,split=2,rows=8")
    args = ap.parse_args(argv)
    if args.gemv_config:
        from qerl.kernels.triton import fp4_grouped_gemv as gemv

        fields = {}
        for item in args.gemv_config.split(","):
            key, value = item.split("=")
            fields[key] = int(value)
        gemv.CONFIG = gemv.GroupedGemvConfig(**fields)
        print(f"decode kernel config: {gemv.CONFIG}")
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
            if args.gemv:
                forced_kernels(row, quant, x, index, weights, args.repeats)
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
            for kernel in ("gemv", "tile") if args.gemv else ():
                if "bf16 grouped_mm, CUDA graph ms" in row:
                    row[f"{kernel} speed-up vs bf16 grouped_mm (graphs)"] = (
                        row["bf16 grouped_mm, CUDA graph ms"] / row[f"nvfp4 {kernel}, CUDA graph ms"])
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
