"""Timeline of a few graph-replayed decode steps: when each kernel starts and ends, relative to the one before.

The aggregate profile (`benchmarks/decode_profile.py`) sums kernel durations; with programmatic dependent
launch kernels overlap, so the sum says little about the step. This records the CUDA kernel events of
`--steps` decode steps (torch.profiler, CUPTI timestamps), and prints per kernel kind (name prefix): count
per step, mean duration, mean gap from the previous kernel's end to this one's end ("adds": what the kind
adds to the critical path when kernels run one after another), and how often it started before its
predecessor ended (overlap). Writes the raw events with --out.

    python benchmarks/experimental/decode_timeline.py --batch 8 --out /tmp/timeline.json
"""

import argparse
import json
import os
import re
import tempfile

import torch


def kernel_events(engine, batch: int, prompt: int, steps: int) -> list[dict]:
    """CUDA kernel events (name, start ts and duration in us) of `steps` decode steps + the engine's sampling
    (`decode_profile.prepared_steps`), by start."""
    from torch.profiler import ProfilerActivity, profile

    from qerl.bench.decode_profile import prepared_steps

    run = prepared_steps(engine, batch, prompt, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    events = [dict(name=e["name"], ts=float(e["ts"]), dur=float(e.get("dur", 0.0)))
              for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def kind_of(name: str) -> str:
    for pat, kind in ((r"lora_a", "lora_a"), (r"permute_x", "permute_x"), (r"bf16_swap", "bf16 gluon"),
                      (r"wgmma", "nvfp4 wgmma"), (r"splitKreduce", "cublas split-K reduce"),
                      (r"swap_kernel", "nvfp4 mma.sync"), (r"rms_norm", "add+rmsnorm"), (r"rope", "rope+kv"),
                      (r"_split_kernel|_combine_kernel|attention", "attention"), (r"silu", "silu*up"), (r"_sample_kernel", "sampling"),
                      (r"gemm|gemv|nvjet|cutlass|xmma", "cublas")):
        if re.search(pat, name):
            return kind
    return "other"


def table(events: list[dict], steps: int) -> list[dict]:
    rows: dict[str, dict] = {}
    prev_end = None
    for e in events:
        end = e["ts"] + e["dur"]
        r = rows.setdefault(kind_of(e["name"]), dict(n=0, dur=0.0, adds=0.0, early=0))
        r["n"] += 1
        r["dur"] += e["dur"]
        if prev_end is not None:
            r["adds"] += max(0.0, end - prev_end)
            r["early"] += e["ts"] < prev_end
        prev_end = end if prev_end is None else max(prev_end, end)
    return [dict(kind=k, per_step=r["n"] / steps, us_each=r["dur"] / r["n"], adds_us_per_step=r["adds"] / steps,
                 overlapped=r["early"] / r["n"]) for k, r in sorted(rows.items(), key=lambda kv: -kv[1]["adds"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7b")
    ap.add_argument("--variant", default="nvfp4+lora")
    ap.add_argument("--batch", default="8")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from qerl.bench.rollout import build_model
    from qerl.rollout.engine import RolloutEngine

    fmt = None if args.variant == "bf16" else args.variant.split("+")[0]
    model = build_model(args.model, None, fmt, 16)
    engine = RolloutEngine(model, max_seq_len=args.prompt + args.steps + 8)
    dump = {}
    for batch in map(int, args.batch.split(",")):
        events = kernel_events(engine, batch, args.prompt, args.steps)
        span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / args.steps
        print(f"\n{args.model} {args.variant} batch {batch}: {span / 1e3:.2f} ms per step (first kernel start to "
              f"last end, incl. sampling), {len(events) / args.steps:.0f} kernels per step")
        print("| kind | per step | us each | adds us/step | started early |\n|---|---:|---:|---:|---:|")
        for r in table(events, args.steps):
            print(f"| {r['kind']} | {r['per_step']:.0f} | {r['us_each']:.1f} | {r['adds_us_per_step']:.0f} "
                  f"| {100 * r['overlapped']:.0f}% |")
        dump[batch] = events
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), args=vars(args), events=dump), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
