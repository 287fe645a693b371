"""A short real run: SmolLM2-135M-Instruct, NVFP4 + LoRA + AQN, GRPO on offline problems (slow)."""

import math
from pathlib import Path

import pytest

from qerl.cli import main
from qerl.rl.run_log import read_metrics

pytestmark = pytest.mark.slow


def test_demo_config_trains_two_steps(tmp_path):
    out = tmp_path / "run"
    config = Path(__file__).resolve().parent.parent / "configs" / "smollm2-demo.yaml"
    code = main(["train", "--config", str(config), "--output-dir", str(out), "steps=2",
                 "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32", "aqn.num_stages=2",
                 "tensorboard=false"])
    assert code == 0
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[1]["aqn_sigma"] == pytest.approx(5e-4)  # the last stage is exactly sigma_end
    for m in metrics:
        assert m["skipped"] == 0 and math.isfinite(m["loss"]) and m["entropy"] > 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "reward_sampled.png").is_file()
