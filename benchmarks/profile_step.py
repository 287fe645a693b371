"""Where one `qerl train` step's GPU time goes: runs WARM steps, then profiles one step with torch.profiler and
prints the top kernels, then per phase (rollout, update) its wall time, summed kernel time, the time the GPU was
busy (kernel intervals merged) and its kernel launches, and the update's host-side operators by their own CPU time.

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


PHASE = "phase:"  # the record_function names of the timed phases


def _device_us(e) -> float:
    return e.device_time if hasattr(e, "device_time") else e.cuda_time


def phase_windows(events) -> dict[str, tuple[float, float]]:
    """{phase: (start, end) in the profiler's microseconds} of the host-side `phase:NAME` ranges."""
    return {e.name[len(PHASE):]: (e.time_range.start, e.time_range.end) for e in events
            if e.name.startswith(PHASE) and e.device_type == torch.autograd.DeviceType.CPU}


def _events(events, device_type, window=None):
    """The profiler's events of one device type that start inside `window` (all when None), phase ranges left out."""
    return (e for e in events if e.device_type == device_type and not e.name.startswith(PHASE)
            and (window is None or window[0] <= e.time_range.start < window[1]))


def _by_name(events, width: int, value: str, measure) -> list[dict]:
    """Rows {"name", "calls", value} summed per event name, largest `value` first."""
    rows = {}
    for e in events:
        r = rows.setdefault(e.name, {"name": e.name[:width], "calls": 0, value: 0.0})
        r["calls"] += 1
        r[value] += measure(e)
    return sorted(rows.values(), key=lambda r: -r[value])


def kernel_rows(events, window=None) -> list[dict]:
    """Device kernels (not the phases' own annotations), by name: calls and summed ms; only those that start inside
    `window` when given (the phases synchronise the device at both ends, so a phase's kernels start inside it)."""
    return _by_name(_events(events, torch.autograd.DeviceType.CUDA, window), 110, "ms", lambda e: _device_us(e) / 1e3)


def busy_ms(events, window=None) -> float:
    """Milliseconds in which at least one kernel ran (the union of the kernels' intervals; overlaps counted once)."""
    spans = sorted((e.time_range.start, e.time_range.end)
                   for e in _events(events, torch.autograd.DeviceType.CUDA, window))
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def host_op_rows(events, window) -> list[dict]:
    """Host-side operators that start inside `window`, by name: calls and self CPU ms (their own time, children
    excluded), so the rows add up to the host time the phase spent in PyTorch."""
    return _by_name(_events(events, torch.autograd.DeviceType.CPU, window), 80, "self_ms",
                    lambda e: e.self_cpu_time_total / 1e3)


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
    events = prof.events()
    rows = kernel_rows(events)
    total = sum(r["ms"] for r in rows)
    print(f"{torch.cuda.get_device_name()}; {' '.join(args.overrides)}")
    print(f"wall: rollout {phases['rollout']:.2f} s, update {phases['update']:.2f} s; kernels {total / 1e3:.2f} s in "
          f"{sum(r['calls'] for r in rows)} launches; step metrics: "
          + ", ".join(f"{k} {metrics[k]:.3g}" for k in ("time_step", "loss_tokens_computed", "rollout_kept_tokens")
                      if k in metrics))
    print("| kernel | calls | ms | share |\n|---|---|---|---|")
    for r in rows[:args.top]:
        print(f"| {r['name']} | {r['calls']} | {r['ms']:.1f} | {r['ms'] / total:.1%} |")
    windows = phase_windows(events)
    split = {}
    print("\n| phase | wall s | kernels s | GPU busy s | busy share | kernel launches |\n|---|---|---|---|---|---|")
    for name, window in windows.items():
        k = kernel_rows(events, window)
        split[name] = {"wall_s": phases[name], "kernel_s": sum(r["ms"] for r in k) / 1e3,
                       "busy_s": busy_ms(events, window) / 1e3, "launches": sum(r["calls"] for r in k)}
        p = split[name]
        print(f"| {name} | {p['wall_s']:.2f} | {p['kernel_s']:.2f} | {p['busy_s']:.2f} | "
              f"{p['busy_s'] / p['wall_s']:.0%} | {p['launches']} |")
    host = host_op_rows(events, windows.get("update"))
    print(f"\nthe update's host operators by own CPU time ({sum(r['calls'] for r in host)} calls, "
          f"{sum(r['self_ms'] for r in host) / 1e3:.2f} s; under the profiler, which adds its own per-op cost)")
    print("| op | calls | self CPU ms |\n|---|---|---|")
    for r in host[:args.top]:
        print(f"| {r['name']} | {r['calls']} | {r['self_ms']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"phases": phases, "split": split, "kernels": rows,
                                              "update_host_ops": host, "metrics": metrics}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
