"""The step-speedup ceiling: KV and weight bytes per decode step from the Qwen2.5 shapes, and a report whose
NVFP4 row is exactly the ideal (rollout / byte ratio, the rest tied) measuring at its ceiling."""

import json

import pytest

from qerl.models.shapes import qwen25_config
from qerl.bench.step_ceiling import ceiling, decode_bytes, kv_cache_bytes, main


def test_kv_bytes_per_position_of_qwen25_7b():
    # 28 layers x (K, V) x 4 KV heads x head_dim 128 x 2 bytes = 57344 bytes per position
    cfg = qwen25_config("7b")
    assert kv_cache_bytes(cfg, sequences=1, prompt=1, completion=0) == 57344
    assert kv_cache_bytes(cfg, sequences=64, prompt=256, completion=512) == 64 * 512 * 57344


def test_decode_bytes_leave_out_the_input_embedding():
    cfg = qwen25_config("7b")
    assert decode_bytes(cfg, 10.0) == pytest.approx(10e9 - 152064 * 3584 * 2)


def _row(variant, rollout, rest, weights_gb):
    return dict(model="7b", variant=variant, prompts=8, sequences=64, rollout=rollout, step=rollout + rest,
                weights_gb=weights_gb)


def test_an_ideal_nvfp4_step_measures_at_the_ceiling(tmp_path, capsys):
    bf16 = _row("bf16", 4.0, 6.0, 15.5)
    probe = ceiling(bf16, _row("nvfp4", 4.0, 6.0, 6.2), prompt=256, completion=512)
    assert 1.5 < probe["byte_ratio"] < 3.5
    ideal = _row("nvfp4", 4.0 / probe["byte_ratio"], 6.0, 6.2)
    c = ceiling(bf16, ideal, prompt=256, completion=512)
    assert c["measured"] == pytest.approx(c["ceiling"]) and c["ceiling"] > 1.0
    assert c["no_rollout_ceiling"] == pytest.approx(10.0 / 6.0)
    assert probe["measured"] == pytest.approx(1.0) and probe["ceiling"] > 1.0
    report = dict(device="cpu", date="2026-01-01", args=dict(prompt=256, completion=512, group=8),
                  results=[bf16, ideal, dict(model="7b", variant="nf4", prompts=8, error="OOM")])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert f"**{c['ceiling']:.2f}x**" in out and out.count("| 7b |") == 1


def test_a_run_too_small_for_the_model_is_refused_and_layers_are_honoured():
    bf16, nvfp4 = _row("bf16", 4.0, 6.0, 0.5), _row("nvfp4", 3.0, 6.0, 0.4)
    with pytest.raises(ValueError, match="not a run of that model"):
        ceiling(bf16, nvfp4, prompt=256, completion=512)
    full = ceiling(_row("bf16", 4.0, 6.0, 15.5), _row("nvfp4", 3.0, 6.0, 6.2), 256, 512)
    two = ceiling(_row("bf16", 4.0, 6.0, 15.5), _row("nvfp4", 3.0, 6.0, 6.2), 256, 512, layers=2)
    assert two["kv_gb"] == pytest.approx(full["kv_gb"] * 2 / 28)


def test_the_module_runs_as_a_command(tmp_path):
    # docs/benchmarks.md and `qerl bench step`'s output name `python -m qerl.bench.step_ceiling REPORT.json`
    import subprocess
    import sys

    bf16, nvfp4 = _row("bf16", 4.0, 6.0, 15.5), _row("nvfp4", 3.0, 6.0, 6.2)
    report = dict(device="cpu", date="2026-01-01", args=dict(prompt=256, completion=512, group=8),
                  results=[bf16, nvfp4])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    out = subprocess.run([sys.executable, "-m", "qerl.bench.step_ceiling", str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert f"**{ceiling(bf16, nvfp4, 256, 512)['ceiling']:.2f}x**" in out
