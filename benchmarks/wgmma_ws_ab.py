"""A/B: the routed NVFP4 product vs the warp-specialized wgmma kernel (`gluon_nvfp4_wgmma_ws`), cuBLAS bf16 as the bar.

`PYTHONPATH=$PWD/src python benchmarks/wgmma_ws_ab.py`: correctness against the float32 reference (M 1/65/200/
300/1030, N 200/4608, K 3584, all 16 FP4 codes, LoRA r 0/16, 1 or 3 K splits, bias, NaN-poisoned outputs; exit 1
on any failure), then CUDA-graph timings on the Qwen2.5-7B shapes, one markdown table. "routed" is
`nvfp4_matmul.nvfp4_linear` as the model calls it (whatever `route` picks at that M).
"""

import argparse
import sys

import torch
import torch.nn.functional as F

LAYERS = {"gate_up": (37888, 3584), "down": (3584, 18944), "qkv": (4608, 3584), "o": (3584, 3584),
          "gate_up_32b": (55296, 5120), "down_32b": (5120, 27648), "gate_up_72b": (59136, 8192),
          "down_72b": (8192, 29568)}  # Qwen2.5-7B, -32B, -72B (N, K)
DEFAULT_LAYERS = "gate_up,down,qkv,o"
L2 = 50 * 2**20
REL_TOL = 1e-2


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true", help="correctness only")
    ap.add_argument("--bench-only", action="store_true", help="timing only (skip correctness)")
    ap.add_argument("--ms", default="64,128,256,512,1024,4096,8192", help="activation rows to time")
    ap.add_argument("--layers", default=DEFAULT_LAYERS, help=f"subset of {','.join(LAYERS)}")
    ap.add_argument("--launch-only", action="store_true",
                    help="launch each WS config twice per layer and M, nothing else (for Nsight Compute: "
                         "ncu -k regex:nvfp4_wgmma_ws ...)")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--waves", default="1", help="programs per SM (K splits from split_for) for the WS kernel")
    ap.add_argument("--configs", default="256,64,3,232 128,64,4,232",
                    help="WS tiles BM,BKH,NS,CREGS separated by spaces (`gluon_nvfp4_wgmma_ws.nvfp4_linear_ws`)")
    ap.add_argument("--no-decode", action="store_true",
                    help="also time each WS tile with zero weights instead of the decode (a counterfactual; zeros draw "
                         "less power, so at the power cap it also runs at a higher clock: benchmarks/ws_clocks.py)")
    ap.add_argument("--dry-run", action="store_true", help="parse arguments, import, print the plan, exit")
    a = ap.parse_args(argv)
    a.ms = [int(v) for v in a.ms.split(",")]
    a.layers = [v for v in a.layers.split(",") if v]
    a.waves = [float(v) for v in a.waves.split(",")]
    a.configs = [tuple(int(v) for v in c.split(",")) for c in a.configs.split()]
    bad = [v for v in a.layers if v not in LAYERS]
    if bad:
        ap.error(f"unknown layers {bad}")
    return a


def _variants(a):
    """(column name, kind, config, waves): 'routed' (nvfp4_matmul.nvfp4_linear), 'ws'."""
    out = [("routed", "routed", None, 0.0)]
    for cfg in a.configs:
        out += [(f"WS BM{cfg[0]} NS{cfg[2]} w{w:g}", "ws", cfg, w) for w in a.waves]
        if a.no_decode:
            out += [(f"WS BM{cfg[0]} NS{cfg[2]} no-decode w{w:g}", "ws-no-decode", cfg, w) for w in a.waves]
    return out


def _call(kind, cfg, waves, x, packed, scale_u8, gs, bias, sms, split=None, lora=None, scale_fp8=None):
    from qerl.kernels import gluon_nvfp4_wgmma_ws as gw
    from qerl.kernels.nvfp4_matmul import nvfp4_linear

    if kind == "routed":
        return nvfp4_linear(x, packed, scale_fp8, gs, bias, lora=lora)
    return gw.nvfp4_linear_ws(x, packed, scale_u8, gs, bias, sms, config=cfg, split=split, lora=lora, waves=waves,
                              no_decode=kind == "ws-no-decode")


def _random_weight(n, k, gen, global_scale=900.0):
    """CPU: raw codes (every one of the 16 E2M1 codes in both nibbles), E4M3 scale bytes 0x00..0x7E (subnormal,
    maximal, zero), ~10% all-zero blocks."""
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    packed[0, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # all 16 x 16 code pairs in row 0
    scale = torch.randint(0, 0x7F, (n, k // 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    zero = torch.rand((n, k // 16), generator=gen) < 0.1
    zero[0, :16] = False  # keep row 0's code table
    packed.view(n, k // 16, 8)[zero] = 0
    scale[zero] = 0
    assert torch.unique(packed & 0xF).numel() == 16 and torch.unique(packed >> 4).numel() == 16
    return {"weight_packed": packed, "weight_scale": scale.view(torch.float8_e4m3fn),
            "weight_global_scale": torch.tensor([global_scale], dtype=torch.float32)}


def _rel_err(out, ref):
    out = out.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def gate(name, tag, run, ref, shape, fails: list[str], worst: dict[str, float]) -> None:
    """Run one variant (run() -> bf16 output) with NaN-poisoned outputs against the float32 `ref`: print ok/FAIL,
    append failures (exceptions included) to `fails`, keep the worst relative error per `name`."""
    from qerl.kernels.workspace import poisoned_outputs

    try:
        with poisoned_outputs():
            y = run()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - report every failing variant
        fails.append(f"{tag}: {type(e).__name__}: {str(e)[:300]}")
        return
    nan = bool(torch.isnan(y).any())
    err = _rel_err(y, ref)
    worst[name] = max(worst.get(name, 0.0), err)
    ok = tuple(y.shape) == shape and y.dtype == torch.bfloat16 and not nan and err < REL_TOL
    print(f"{'ok  ' if ok else 'FAIL'} {tag}: rel err {err:.3e}{' NaN' if nan else ''}", flush=True)
    if not ok:
        fails.append(f"{tag}: rel err {err:.3e}, NaN {nan}, shape {tuple(y.shape)}")


def check(a) -> list[str]:
    from qerl.formats.nvfp4 import dequantize_nvfp4
    from qerl.kernels.operands import global_scale_f32, scale_bytes
    from qerl.kernels.route import sm_count

    sms = sm_count(torch.device("cuda"), 4)
    kernels = [("routed", "routed", None, 0.0)] + [(f"WS BM{c[0]} NS{c[2]}", "ws", c, 1.0)
                                                    for c in sorted({(64, 64, 4, 232), *a.configs})]
    fails, worst = [], {}
    k = 3584
    case = 0
    for m in (1, 65, 200, 300, 1030):
        for n in (200, 4608):
            gen = torch.Generator().manual_seed(1000 * m + n)
            wc = _random_weight(n, k, gen)
            ref_w = dequantize_nvfp4(**wc, dtype=torch.float32)
            w = {name: t.cuda() for name, t in wc.items()}
            packed, scale_u8, gs = w["weight_packed"], scale_bytes(w["weight_scale"]), global_scale_f32(
                w["weight_global_scale"])
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            ref0 = x.float() @ ref_w.t()
            xd = x.cuda()
            for lora_r in (0, 16):
                for split in (1, 3):
                    case += 1
                    bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16) if case % 2 else None
                    ref = ref0.clone()
                    if bias is not None:
                        ref += bias.float()
                    lora = None
                    if lora_r:  # h as a column slice of a wider matrix, as the engine passes it
                        hw = torch.randn(m, lora_r + 5, generator=gen).to(torch.bfloat16)
                        lb = (torch.randn(n, lora_r, generator=gen) * 0.1).to(torch.bfloat16)
                        ref += hw[:, 3:3 + lora_r].float() @ lb.float().t()
                        lora = (hw.cuda()[:, 3:3 + lora_r], lb.cuda())
                    bd = bias.cuda() if bias is not None else None
                    for name, kind, cfg, waves in kernels:
                        tag = f"{name}: M={m} N={n} K={k} lora_r={lora_r} split={split} bias={bias is not None}"
                        gate(name, tag, lambda: _call(kind, cfg, waves, xd, packed, scale_u8, gs, bd, sms, split=split,
                                                      lora=lora, scale_fp8=w["weight_scale"]),
                             ref, (m, n), fails, worst)
    print("worst relative error per kernel: " + ", ".join(f"{k_}: {v:.3e}" for k_, v in worst.items()))
    return fails


def bench(a) -> None:
    from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
    from qerl.kernels import gluon_nvfp4 as gk
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}", flush=True)
    variants = _variants(a)
    rows = []
    for layer in a.layers:
        n, k = LAYERS[layer]
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
        ops = [(e["weight_packed"], scale_bytes(e["weight_scale"]), global_scale_f32(e["weight_global_scale"]),
                e["weight_scale"]) for e in q]
        for m in a.ms:
            xs, calls = _decode_inputs(m, k, fp4_bytes, copies)
            t_cub = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, a.replays)
            times = {}
            for name, kind, cfg, waves in variants:
                def fn(i, kind=kind, cfg=cfg, waves=waves):
                    p, s, g, sf = ops[i % copies]
                    return _call(kind, cfg, waves, xs[i % 2], p, s, g, None, sms, scale_fp8=sf)
                try:
                    times[name] = _graph_time(fn, calls, a.replays)
                except Exception as e:  # noqa: BLE001 - e.g. out of resources: report and go on
                    print(f"  {layer} M={m} {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    times[name] = float("nan")
            splits = {name: gk.split_for(m, n, k, (128, cfg[0], cfg[1]), sms, waves)[0] if cfg else 0
                      for name, _, cfg, waves in variants}
            rows.append((layer, m, t_cub, times, splits))
            best = min((t, nm) for nm, t in times.items() if t == t)
            print(f"{layer} M={m}: cuBLAS {t_cub * 1e6:.1f} us | " + " | ".join(
                f"{nm} {t * 1e6:.1f} ({t_cub / t:.2f}x, s{splits[nm]})" for nm, t in times.items())
                + f" | best {best[1]}", flush=True)
        bf = q = ops = None
        torch.cuda.empty_cache()
    names = [v[0] for v in variants]
    print("\nmicroseconds per call (CUDA-graph replay); (x) = cuBLAS time / kernel time, > 1 is faster than cuBLAS\n")
    print("| layer (N, K) | M | cuBLAS bf16 | " + " | ".join(names) + " | best |")
    print("|---|---:|---:|" + "---:|" * len(names) + "---|")
    for layer, m, t_cub, times, splits in rows:
        cells = [f"{times[nm] * 1e6:.1f} ({t_cub / times[nm]:.2f}x)" for nm in names]
        best = min((t, nm) for nm, t in times.items() if t == t)
        print(f"| {layer} {LAYERS[layer]} | {m} | {t_cub * 1e6:.1f} | " + " | ".join(cells) + f" | {best[1]} |")
    print("\nK splits per variant (split_for at its waves): " + "; ".join(
        f"{layer} M={m}: " + " ".join(f"{nm.split(' (')[0]}=s{s}" for nm, s in splits.items())
        for layer, m, _, _, splits in rows[:4]) + (" ..." if len(rows) > 4 else ""))
    print("\nregisters, spills and shared memory of the kernel: python benchmarks/compile_wgmma_ws.py BM=... NS=...")


def launch(a) -> None:
    from qerl.bench.kernels import _weights
    from qerl.kernels import gluon_nvfp4_wgmma_ws as gw
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for layer in a.layers:
        n, k = LAYERS[layer]
        _, q = _weights(n, k, 1)
        ops = (q[0]["weight_packed"], scale_bytes(q[0]["weight_scale"]), global_scale_f32(q[0]["weight_global_scale"]))
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for cfg in a.configs:
                for no_decode in (False, True) if a.no_decode else (False,):
                    for _ in range(2):
                        gw.nvfp4_linear_ws(x, *ops, None, sms, config=cfg, no_decode=no_decode)
                    torch.cuda.synchronize()
                    print(f"{layer} {n}x{k} M={m} config {cfg} no_decode={no_decode}: launched twice", flush=True)


def main(argv=None) -> int:
    a = _args(argv)
    # imports the GPU path needs (fail here, loudly, rather than after minutes of checks)
    from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights  # noqa: F401
    from qerl.kernels import gluon_nvfp4_wgmma_ws, nvfp4_matmul  # noqa: F401
    from qerl.kernels.workspace import capture_graph  # noqa: F401

    if a.dry_run:
        print("plan: check" * (not a.bench_only) + (" + " if not (a.bench_only or a.check_only) else "")
              + "bench" * (not a.check_only))
        print("layers", {ly: LAYERS[ly] for ly in a.layers}, "M", a.ms)
        print("timed variants:", [v[0] for v in _variants(a)])
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("FAIL: needs an sm_90 GPU (wgmma)", file=sys.stderr)
        return 2
    if a.launch_only:
        launch(a)
        return 0
    if not a.bench_only:
        fails = check(a)
        if fails:
            print(f"\nFAIL: {len(fails)} correctness check(s) failed:", file=sys.stderr)
            for f in fails:
                print("  " + f, file=sys.stderr)
            return 1
        print("all correctness checks passed", flush=True)
    if not a.check_only:
        bench(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
