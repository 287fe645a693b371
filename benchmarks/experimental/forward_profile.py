"""Where the training-side forward of one micro-batch goes, NVFP4 vs bf16 LoRA (GPU).

`python benchmarks/experimental/forward_profile.py [--model 7b] [--rows 8] [--tokens 2304] [--backward]`: builds the
random-weight policy of `qerl bench step` for each format, runs `completion_logprobs` (the reference /
old-log-prob pass of an RL step: forward only) on `--rows` sequences of `--tokens` tokens, and prints the
wall time per pass, the GPU kernel time by group (torch.profiler) and the largest kernels, so a gap between
the formats can be traced to its kernels or to time outside them. --backward: the loss pass instead
(forward, recomputed forward and backward under gradient checkpointing).
"""

import argparse
import time

import torch


def groups_of(name: str) -> str:
    import re

    for g, pat in (("dequant", r"dequant"), ("gemm", r"gemm|nvjet|cutlass|xmma|gemv|splitK"),
                   ("attention", r"flash|fmha|attention|sdpa|efficient"), ("fp4 fused", r"_fp4_|swap")):
        if re.search(pat, name, re.IGNORECASE):
            return g
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="7b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2304)
    ap.add_argument("--formats", default="nvfp4,bf16")
    ap.add_argument("--backward", action="store_true",
                    help="forward + backward of a summed log-prob under gradient checkpointing (the loss pass)")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from qerl.bench.rollout import free
    from qerl.bench.step import build_random_policy, model_config
    from qerl.rl.logprobs import completion_logprobs

    dev = torch.device("cuda")
    for fmt in args.formats.split(","):
        model = build_random_policy(model_config(args.model), fmt, 32, dev)
        if args.backward:
            from qerl.rl.trainer import enable_gradient_checkpointing

            enable_gradient_checkpointing(model)
        P = 256
        ids = torch.randint(3, 1000, (args.rows, args.tokens), device=dev)
        pm = torch.ones(args.rows, P, dtype=torch.bool, device=dev)
        cm = torch.ones(args.rows, args.tokens - P, dtype=torch.bool, device=dev)

        def run():
            if args.backward:
                completion_logprobs(model, ids[:, :P], pm, ids[:, P:], cm).mean().backward()
                return None
            with torch.no_grad():
                return completion_logprobs(model, ids[:, :P], pm, ids[:, P:], cm)

        run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        rows = {}
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = e.device_time if hasattr(e, "device_time") else e.cuda_time
            r = rows.setdefault(e.name, [0, 0.0])
            r[0] += 1
            r[1] += t
        total = sum(v[1] for v in rows.values())
        by = {}
        for n, (c, t) in rows.items():
            by[groups_of(n)] = by.get(groups_of(n), 0.0) + t
        print(f"\n## {args.model} {fmt}: {wall * 1e3:.1f} ms per pass (wall), {total / 1e3:.1f} ms of kernels; "
              + ", ".join(f"{g} {t / 1e3:.1f} ms" for g, t in sorted(by.items(), key=lambda kv: -kv[1])))
        for n, (c, t) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:10]:
            print(f"  {t / 1e3:8.2f} ms {c:5d} calls  {n[:110]}")
        del model
        free()


if __name__ == "__main__":
    main()
