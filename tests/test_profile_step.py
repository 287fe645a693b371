"""benchmarks/profile_step.py's accounting on a real CPU profile: phase windows, the host operators inside a phase
only, and the merged busy time of overlapping intervals."""

from types import SimpleNamespace

import torch
from bench_scripts import load_benchmark
from torch.profiler import ProfilerActivity, profile, record_function

ps = load_benchmark("profile_step")


def test_host_ops_are_counted_inside_their_phase_only():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            x @ x  # outside any phase
        with record_function("phase:update"):
            for _ in range(5):
                torch.relu(x @ x)
    events = prof.events()
    windows = ps.phase_windows(events)
    assert set(windows) == {"update"} and windows["update"][0] < windows["update"][1]
    rows = {r["name"]: r for r in ps.host_op_rows(events, windows["update"])}
    assert rows["aten::mm"]["calls"] == 5 and rows["aten::relu"]["calls"] == 5
    assert all(r["self_ms"] >= 0 for r in rows.values()) and "phase:update" not in rows
    assert ps.kernel_rows(events) == [] and ps.busy_ms(events) == 0.0  # no device here


def test_busy_time_merges_overlapping_kernels():
    cuda = torch.autograd.DeviceType.CUDA

    def kernel(a, b, name="k"):
        return SimpleNamespace(device_type=cuda, name=name, time_range=SimpleNamespace(start=a, end=b))

    spans = [kernel(0, 100), kernel(50, 150), kernel(300, 400), kernel(320, 330), kernel(0, 1000, "phase:update")]
    assert ps.busy_ms(spans) == 0.25  # [0, 150) and [300, 400) in microseconds; the phase annotation is no kernel
    assert ps.busy_ms(spans, window=(200, 1000)) == 0.1
