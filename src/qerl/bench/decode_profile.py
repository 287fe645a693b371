"""Where a decode step's GPU time goes: kernels of the engine's decode step, grouped and timed.

Builds a random-weight Qwen2.5-shaped model (as `qerl bench rollout`), prefills a batch of prompts, then
profiles `--steps` decode steps (the engine's step: one CUDA-graph replay, or eager with `--eager`)
plus the sampling of each next token as the engine samples (one launch where `fused_sampling_applies`),
with torch.profiler's CUDA activity. Prints, per variant and
batch, the kernels by GPU time per step (calls per step, us per step, share of the step) and groups them
into matmul / attention / norm+elementwise / sampling, so a change can be aimed at the largest part.

    python -m qerl.bench.decode_profile --models 7b --variants bf16+lora,nvfp4+lora --batches 8,64
"""

import argparse
import datetime
import json
import re

import torch

GROUPS = (  # first match wins; kernel names as CUPTI reports them
    ("bf16 gluon kernel", r"bf16_swap"),
    ("fp4 kernels", r"_fp4_|fp4_gemv|_gemv_kernel|_swap|_splitk_reduce"),
    ("fused norm/rope", r"_add_rms_norm|_rope_kernel"),
    ("dequant", r"dequant"),
    ("cublas gemm", r"gemm|gemv|cutlass|sm90_xmma|ampere_|nvjet|splitK|cublas"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("reduce", r"reduce_kernel|sum_|Reduce"),
    ("sampling", r"_sample_kernel|sort|topk|softmax|multinomial|exponential|cumsum|log_softmax|argmax|max_"),
    ("copy/index", r"copy|index|scatter|gather|cat|fill|where"),
    ("elementwise", r"elementwise|vectorized|unrolled|pow|rsqrt|mul|add|silu"),
)


def group_of(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name, re.IGNORECASE):
            return g
    return "other"


def prepared_steps(engine, batch: int, prompt: int, steps: int):
    """Prefill a batch of `prompt` random tokens, capture the graphs and fill the cache; returns run(), which
    performs `steps` decode steps (the engine's step at a fixed attended length) each followed by the
    engine's sampler (one launch, `triton.sampling`, where it applies; else `next_token`) and syncs."""
    from ..rollout.sampling import SamplingParams, fused_sampling_applies, next_token
    from .rollout import prompts_tensor

    ids = prompts_tensor(batch, prompt, engine.model.config.vocab_size)
    engine.warmup(batch, prompt + steps + 1)
    engine.generate(ids, steps + 1, SamplingParams(temperature=1.0), seed=0, ignore_eos=True)  # cache filled
    sp = SamplingParams(temperature=1.0)
    kv = engine.attended_len(prompt + steps)
    # every row decodes at slot `prompt` (the step's cost does not depend on which slot it rewrites)
    engine.slot_base[:batch].fill_(prompt)
    engine.slot_lo[:batch].fill_(0)
    engine.step_index.fill_(0)
    state = {"logits": engine.decode(batch, kv)}
    torch.cuda.synchronize()
    fused = engine.fused_sampling and fused_sampling_applies(state["logits"], sp)
    if fused:
        from ..kernels.triton.sampling import sample_triton

    def run():
        for i in range(steps):
            if fused:
                tok, _, _ = sample_triton(state["logits"], sp.temperature, 2**32, i)
            else:
                tok, _, _ = next_token(state["logits"], sp, None)
            engine.step_tokens.copy_(tok)
            state["logits"] = engine.decode(batch, kv)
        torch.cuda.synchronize()

    return run


def profile_steps(engine, batch: int, prompt: int, steps: int) -> list[dict]:
    """Kernel table of `steps` decode steps (+ sampling) after a prefill; times are per step, us."""
    from torch.profiler import ProfilerActivity, profile

    run = prepared_steps(engine, batch, prompt, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    rows = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        r = rows.setdefault(e.name, dict(name=e.name, calls=0, us=0.0))
        r["calls"] += 1
        r["us"] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    out = sorted(rows.values(), key=lambda r: -r["us"])
    for r in out:
        r["calls"] /= steps
        r["us"] /= steps
        r["group"] = group_of(r["name"])
    return out


def summary(rows: list[dict]) -> dict[str, float]:
    total = sum(r["us"] for r in rows)
    groups: dict[str, float] = {}
    for r in rows:
        groups[r["group"]] = groups.get(r["group"], 0.0) + r["us"]
    return dict(total_us=total, kernels_per_step=sum(r["calls"] for r in rows), **groups)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="decode_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b")
    ap.add_argument("--variants", default="bf16+lora,nvfp4+lora")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from ..rollout.engine import RolloutEngine
    from .rollout import build_model, free

    results = []
    for size in args.models.split(","):
        for variant in args.variants.split(","):
            fmt = None if variant == "bf16" else variant.split("+")[0]
            model = build_model(size, args.layers, fmt, args.lora_r)
            engine = RolloutEngine(model, max_seq_len=args.prompt + args.steps + 8, cuda_graphs=not args.eager)
            for batch in map(int, args.batches.split(",")):
                rows = profile_steps(engine, batch, args.prompt, args.steps)
                s = summary(rows)
                results.append(dict(model=size, variant=variant, batch=batch, summary=s, kernels=rows))
                print(f"\n## {size} {variant} batch {batch}: {s['total_us'] / 1e3:.2f} ms GPU per step, "
                      f"{s['kernels_per_step']:.0f} kernels")
                print(" | ".join(f"{k} {v / 1e3:.2f} ms" for k, v in s.items()
                                 if k not in ("total_us", "kernels_per_step")))
                print("| group | calls/step | us/step | % | kernel |\n|---|---:|---:|---:|---|")
                for r in rows[: args.top]:
                    print(f"| {r['group']} | {r['calls']:.0f} | {r['us']:.0f} | {100 * r['us'] / s['total_us']:.1f} "
                          f"| {r['name'][:90]} |")
            del engine, model
            free()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), date=str(datetime.date.today()),
                           torch=torch.__version__, args=vars(args), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
