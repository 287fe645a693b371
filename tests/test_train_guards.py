"""`qerl train` refuses to lie: a reward that always fails stops the run (with a checkpoint), a bad reward or
data source is reported before the model loads, and the GPU's first-step compilation is announced."""

import os
import textwrap

import pytest
import torch

from qerl.cli import main
from qerl.config import ConfigError, load_config
from qerl.models.registry import persist_compiled_kernels
from qerl.rl.run_log import read_metrics
from qerl.rl.trainer import Trainer, compile_notice

from tiny import write_arith

# Reward functions of a user module, imported by name ("guard_rewards:always_raises") in the reward worker.
GUARD_REWARDS = textwrap.dedent('''
    import math

    calls = 0  # per worker process, which lives for the whole run


    def always_raises(prompts, completions, **columns):
        raise RuntimeError("reward bug\\nsecond line")


    def flaky(prompts, completions, **columns):
        """Odd calls: raises. Even calls: scores only the first row (NaN for the others)."""
        global calls
        calls += 1
        if calls % 2:
            raise RuntimeError("flaky")
        return [1.0] + [math.nan] * (len(completions) - 1)
''')


@pytest.fixture
def data_file(tmp_path):
    return write_arith(tmp_path / "arith.jsonl", range(1, 6), range(1, 6))


@pytest.fixture
def guard_rewards(tmp_path, monkeypatch):
    (tmp_path / "guard_rewards.py").write_text(GUARD_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward worker gets the parent's sys.path


def _overrides(tiny_dir, data_file, out, **extra):
    base = {"model.name": str(tiny_dir), "data.train": str(data_file), "data.max_prompt_tokens": 32,
            "data.suffix": "none", "rollout.prompts_per_step": 2, "rollout.group_size": 4,
            "rollout.max_new_tokens": 4, "lora.r": 4, "lora.alpha": 8, "steps": 4, "output_dir": str(out),
            "tensorboard": False, "plots": False, "reward_timeout_s": 30}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.mark.parametrize("rewards", ["['guard_rewards:always_raises']",
                                     "[tiny_rewards:digit_reward, 'guard_rewards:always_raises']"])
def test_a_reward_failing_on_every_row_stops_the_run_with_a_checkpoint(tiny_dir, data_file, guard_rewards, tmp_path,
                                                                      capsys, rewards):
    # alone it leaves all-zero rewards; beside a working reward its weight silently becomes zero: both stop
    out = tmp_path / "run"
    args = _overrides(tiny_dir, data_file, out, rewards=rewards, max_reward_failure_steps=2)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    line = next(l for l in err.splitlines() if l.startswith("error: "))
    assert ("reward 'guard_rewards:always_raises' failed on every row for 2 steps in a row "
            "(last error: raised RuntimeError: reward bug)") in line
    assert "second line" not in err  # one line
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert (out / "checkpoints" / "step-000002" / "adapter").is_dir()  # kept: fix the reward, then --resume
    assert "compiles" not in err  # no GPU, nothing to compile


def test_a_reward_that_scores_some_rows_or_recovers_does_not_stop_the_run(tiny_dir, data_file, guard_rewards,
                                                                          tmp_path):
    # steps 1 and 3 fail on every row, steps 2 and 4 score one row: never 2 failed steps in a row
    out = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_dir, data_file, out, rewards="['guard_rewards:flaky']",
                                       max_reward_failure_steps=2))
    Trainer(cfg).train()
    errors = [m["reward_errors/flaky"] for m in read_metrics(out / "metrics.jsonl")]
    assert errors == [8, 7, 8, 7]


@pytest.mark.parametrize("field, value, message", [
    ("rewards", "[math, no_such_reward]", "unknown reward 'no_such_reward'"),
    ("rewards", "['no_such_module:f']", "reward 'no_such_module:f': cannot import"),
    ("rewards", "['tiny:no_such_function']", "reward 'tiny:no_such_function': cannot import"),
    ("data.train", "MISSING", "missing.jsonl: no such file"),
    ("data.train", "no-such-dataset", "unknown dataset 'no-such-dataset'"),
    ("data.train", "UNREADABLE", "cannot read it"),
])
def test_a_bad_reward_or_data_source_fails_before_the_model_loads(tiny_dir, data_file, tmp_path, monkeypatch, field,
                                                                  value, message):
    import pathlib

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr("qerl.rl.trainer.build_policy", no_model)
    if value == "MISSING":
        value = str(tmp_path / "missing.jsonl")
    if value == "UNREADABLE":  # as a non-root user would see a chmod 000 file (root reads everything)
        value, real_open = str(data_file), pathlib.Path.open

        def denied(self, *args, **kwargs):
            if self == data_file:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "open", denied)
    cfg = load_config(None, _overrides(tiny_dir, data_file, tmp_path / "run", **{field: value}))
    with pytest.raises(ValueError, match=message):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_cli_names_a_bad_reward_in_one_line(tiny_dir, data_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("qerl.rl.trainer.build_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["train", *_overrides(tiny_dir, data_file, tmp_path / "run", rewards="['mypkg.rewards:score']")]) == 2
    assert "error: reward 'mypkg.rewards:score': cannot import (No module named 'mypkg')" in capsys.readouterr().err


def test_max_reward_failure_steps_must_be_at_least_one():
    assert load_config(None, []).max_reward_failure_steps == 3
    with pytest.raises(ConfigError, match="max_reward_failure_steps must be > 0"):
        load_config(None, ["max_reward_failure_steps=0"])


def test_the_compilation_notice_is_for_gpus_only(monkeypatch):
    assert compile_notice(torch.device("cpu")) is None
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("QERL_CACHE", "/data/qerl-cache")
    assert "compiles" in compile_notice(torch.device("cuda"))
    assert "/data/qerl-cache/triton" in compile_notice(torch.device("cuda", 0))
    persist_compiled_kernels()  # what the CLI does first: Triton then compiles into qerl's cache
    assert os.environ["TRITON_CACHE_DIR"] == "/data/qerl-cache/triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/scratch/triton")
    assert "/scratch/triton" in compile_notice(torch.device("cuda"))
