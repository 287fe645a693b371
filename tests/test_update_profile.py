"""The policy update under the profiler (qerl.bench.update_profile, `qerl bench step --profile-update`): a real
step of the step benchmark's runner on a tiny random Qwen2 (CPU: aten ops; GPU: CUDA kernels)."""

import pytest
import torch
from transformers import Qwen2Config

from qerl.bench.step import StepRunner, parse_args, time_cells
from qerl.bench.update_profile import profile_table, union_ms
from qerl.rl.distributed import DistContext

from kernel_testing import require_cuda
from test_bench_step import TINY, _args, build_random_policy


def test_busy_time_counts_overlapping_intervals_once():
    assert union_ms([]) == 0.0
    assert union_ms([(0, 1000), (500, 2000), (3000, 3500), (3100, 3200)]) == pytest.approx(2.5)  # us -> ms


def _check(summary: dict, device: str) -> None:
    assert summary["kernels"] > 0 and summary["kernel_ms"] > 0 and summary["wall_ms"] > 0
    top = summary["top"]
    assert top and all(n >= 1 for _, _, n in top)
    assert [ms for _, ms, _ in top] == sorted((ms for _, ms, _ in top), reverse=True)
    assert sum(ms for _, ms, _ in top) <= summary["kernel_ms"] + 1e-9
    if device == "cpu":
        assert all(name.startswith("aten::") for name, _, _ in top)
        assert summary["busy_ms"] == summary["kernel_ms"]
    else:  # kernels, not host ops; the union of their intervals fits in the profiled wall time
        assert not any(name.startswith("aten::") for name, _, _ in top)
        assert 0 < summary["busy_ms"] <= min(summary["kernel_ms"], summary["wall_ms"]) + 1e-6


def test_a_profiled_step_reports_its_update_and_still_trains():
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    runner = StepRunner(model, _args("--kl-beta", "0"), DistContext(), sigma=0.0)
    t = runner.step(prompts=2, completion=6, profile_update=True)
    _check(t["update_profile"], "cpu")
    assert runner.optimizer.state and t["loss_tokens_needed"] > 0  # the whole update ran under the profiler
    assert "update_profile" not in runner.step(prompts=2, completion=6)


def test_profile_update_adds_one_untimed_step_per_cell_and_a_block_per_row():
    _, args = parse_args(["--models", "7b", "--variants", "bf16,nvfp4", "--prompts", "2", "--steps", "1",
                          "--completion", "4", "--warmup-completion", "2", "--prompt", "5", "--group", "2",
                          "--micro-batch", "2", "--kl-beta", "0", "--profile-update"])
    runners, cells = {}, {}
    for fmt in args.variants:
        model = build_random_policy(Qwen2Config(**TINY), fmt, lora_r=4, device=torch.device("cpu"))
        runners[fmt] = StepRunner(model, args, DistContext(), sigma=0.0)
        cells[fmt] = dict(model="7b", variant=fmt, world=1, weights_gb=0.0)
    rows = time_cells(runners, cells, 2, args, DistContext())
    for row in rows:
        _check(row["update_profile"], "cpu")
        assert row["steps_timed"] == 2  # the profiled step is not among the timed ones
    text = profile_table(rows)
    assert text.count("update wall") == 2 and "7b nvfp4 continuous+packed: update wall" in text
    assert "| `aten::" in text


def test_busy_adds_one_untimed_step_per_cell_with_each_phase_busy_share():
    """--busy: one more step per cell, each phase under its own profiler session; the row's "busy" gives every
    phase that ran its wall and busy milliseconds and their ratio, and the timed steps stay as they were."""
    _, args = parse_args(["--models", "7b", "--variants", "nvfp4", "--prompts", "2", "--steps", "1",
                          "--completion", "4", "--warmup-completion", "2", "--prompt", "5", "--group", "2",
                          "--micro-batch", "2", "--busy"])
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    runners = {"nvfp4": StepRunner(model, args, DistContext(), sigma=0.0)}
    cells = {"nvfp4": dict(model="7b", variant="nvfp4", world=1, weights_gb=0.0)}
    (row,) = time_cells(runners, cells, 2, args, DistContext())
    assert row["steps_timed"] == 1 and "update_profile" not in row
    assert set(row["busy"]) == {"rollout", "reference", "loss_backward", "optimizer"}
    for phase in row["busy"].values():
        assert phase["wall_ms"] > 0 and phase["busy_ms"] > 0
        assert phase["share"] == pytest.approx(phase["busy_ms"] / phase["wall_ms"])


@pytest.mark.gpu
def test_gpu_profile_names_cuda_kernels_and_busy_time():
    require_cuda()
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cuda"))
    runner = StepRunner(model, _args("--kl-beta", "0"), DistContext(), sigma=0.0)
    runner.step(prompts=2, completion=6)  # compile outside the profile
    _check(runner.step(prompts=2, completion=6, profile_update=True)["update_profile"], "cuda")
    busy = runner.step(prompts=2, completion=6, busy=True)["busy"]  # kernels of CUDA graph replays in the rollout
    assert {"rollout", "loss_backward"} <= set(busy)
    assert all(0 < p["busy_ms"] <= p["wall_ms"] + 1e-6 for p in busy.values())
