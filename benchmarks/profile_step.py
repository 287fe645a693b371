"""Where one `qerl train` step's GPU time goes: runs WARM steps, then profiles one step with torch.profiler and
prints the wall time of the rollout and the update, the summed kernel time of each, and the top kernels / ops.

    python benchmarks/profile_step.py model.name=/tmp/q15 model.format=nvfp4 --out prof.json

Arguments are `qerl train` overrides (defaults: the GSM8K run of benchmarks/train_speed.py).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import BASE  # noqa: E402


def kernel_rows(prof) -> list[dict]:
    rows = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        r = rows.setdefault(e.name, {"name": e.name[:110], "calls": 0, "ms": 0.0})
        r["calls"] += 1
        r["ms"] += (e.device_time if hasattr(e, "device_time") else e.cuda_time) / 1e3
    return sorted(rows.values(), key=lambda r: -r["ms"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--warm", type=int, default=2, help="unprofiled steps first (kernel compilation)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from rich.console import Console
    from torch.profiler import ProfilerActivity, profile, record_function

    from qerl.config import load_config
    from qerl.rl import step as step_mod
    from qerl.rl import trainer as trainer_mod

    sets = {**BASE, "steps": args.warm + 1, "output_dir": tempfile.mkdtemp()}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()] + args.overrides)
    tr = trainer_mod.Trainer(cfg, console=Console(stderr=True))
    for _ in range(args.warm):
        tr.train_step()
    phases = {}
    collect, update = trainer_mod.collect_experience, step_mod.policy_update

    def timed(name, fn):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with record_function(f"phase:{name}"):
                out = fn(*a, **k)
            torch.cuda.synchronize()
            phases[name] = time.perf_counter() - t0
            return out
        return wrapper

    # the trainer calls collect_experience, the step calls policy_update: patch each where it is looked up
    trainer_mod.collect_experience, step_mod.policy_update = timed("rollout", collect), timed("update", update)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        metrics = tr.train_step()
    rows = kernel_rows(prof)
    total = sum(r["ms"] for r in rows)
    print(f"{torch.cuda.get_device_name()}; {' '.join(args.overrides)}")
    print(f"wall: rollout {phases['rollout']:.2f} s, update {phases['update']:.2f} s; kernels {total / 1e3:.2f} s in "
          f"{sum(r['calls'] for r in rows)} launches; step metrics: "
          + ", ".join(f"{k} {metrics[k]:.3g}" for k in ("time_step", "loss_tokens_computed", "rollout_kept_tokens")
                      if k in metrics))
    print("| kernel | calls | ms | share |\n|---|---|---|---|")
    for r in rows[:args.top]:
        print(f"| {r['name']} | {r['calls']} | {r['ms']:.1f} | {r['ms'] / total:.1%} |")
    ops = prof.key_averages()
    top_ops = sorted(ops, key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))[:args.top]
    print("\n| op | calls | device ms | cpu ms |\n|---|---|---|---|")
    for e in top_ops:
        dev = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3
        print(f"| {e.key[:80]} | {e.count} | {dev:.1f} | {e.cpu_time_total / 1e3:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"phases": phases, "kernels": rows, "metrics": metrics}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
