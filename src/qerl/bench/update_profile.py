"""Where one call's time goes: the call run once under `torch.profiler`, its device kernels summed by name, and
how much of its wall time the device was busy (`qerl bench step --profile-update`; `--busy` profiles phase by
phase with `PhaseBusy`): docs/cli.md ("Profiling"). On the CPU (tests) the "kernels" are the aten ops, by self
time; busy is their sum.
"""

import collections
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from .options import md_header

NAME_CHARS = 90  # kernel names carry whole template signatures; the start says which kernel it is


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) covered by (start_us, end_us) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def summarize_events(events, wall_ms: float, device_type: str, top: int = 12) -> dict:
    """The profile summary from torch.profiler's FunctionEvents: {"wall_ms", "busy_ms", "kernel_ms", "kernels"
    (launches), "top": [[name, ms, calls], ...]}."""
    by_name, calls, intervals = collections.Counter(), collections.Counter(), []
    for e in events:
        if device_type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            start, end = e.time_range.start, e.time_range.end
            us = end - start
            intervals.append((start, end))
        else:
            if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        name = e.name[:NAME_CHARS]
        by_name[name] += us / 1e3
        calls[name] += 1
    kernel_ms = sum(by_name.values())
    busy = union_ms(intervals) if device_type == "cuda" else kernel_ms
    return {"wall_ms": wall_ms, "busy_ms": busy, "kernel_ms": kernel_ms, "kernels": sum(calls.values()),
            "top": [[n, ms, calls[n]] for n, ms in by_name.most_common(top)]}


@contextmanager
def profiled(device: torch.device, top: int = 12):
    """The block run under the profiler (CUDA kernels on a GPU, aten ops on the CPU); yields a dict that holds
    its summary (`summarize_events`) once the block is done."""
    on_gpu = device.type == "cuda"
    # on a GPU the kernels alone: recording every host op too would stretch the wall time being explained
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    summary = {}
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        yield summary
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3
    summary.update(summarize_events(prof.events(), wall_ms, device.type, top))


def profile_call(fn, device: torch.device, top: int = 12):
    """(fn(), summary) with fn run once under the profiler (`profiled`)."""
    with profiled(device, top) as summary:
        out = fn()
    return out, summary


class PhaseBusy:
    """A `phase` hook for `qerl.rl.step.rl_step`: each phase run under its own profiler session (`profiled`), its
    wall and device-busy milliseconds summed per phase name (a phase that runs twice, as the loss pass with
    num_updates > 1, adds up). `shares()`: {phase: {"wall_ms", "busy_ms", "share"}}, share = busy / wall."""

    def __init__(self, device: torch.device):
        self.device, self.ms = device, {}

    @contextmanager
    def __call__(self, name: str):
        with profiled(self.device, top=0) as summary:
            yield
        wall, busy = self.ms.get(name, (0.0, 0.0))
        self.ms[name] = (wall + summary["wall_ms"], busy + summary["busy_ms"])

    def shares(self) -> dict[str, dict[str, float]]:
        return {name: {"wall_ms": wall, "busy_ms": busy, "share": busy / max(wall, 1e-9)}
                for name, (wall, busy) in self.ms.items()}


def profile_table(rows: list[dict]) -> str:
    """One block per row that carries an "update_profile": wall / busy / kernel time, then its top kernels."""
    parts = []
    for r in rows:
        p = r.get("update_profile")
        if not p:
            continue
        head = (f"{r.get('model', '')} {r.get('variant', '')} {r.get('mode', '')}: update wall {p['wall_ms']:.0f} ms, "
                f"device busy {p['busy_ms']:.0f} ms ({p['busy_ms'] / max(p['wall_ms'], 1e-9):.0%}), kernels "
                f"{p['kernel_ms']:.0f} ms in {p['kernels']} launches")
        lines = [head, md_header("kernel | ms | calls", "lrr")]
        lines += [f"| `{name}` | {ms:.1f} | {n} |" for name, ms, n in p["top"]]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
