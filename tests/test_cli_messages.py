"""What the `qerl` command says: the help lists every command, an option typo gets the closest option, a closed
pipe is no traceback, `train` says what it is doing before its first step and keeps a step to one line in a
log, and errors name the option (data.limit, seed, data.answer_key, a directory given as a file, a reward
that returned a string); written files get the umask's permissions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qerl.cli import main
from qerl.config import ConfigError, load_config

from tiny import write_arith


@pytest.fixture
def data_file(tmp_path):
    return write_arith(tmp_path / "arith.jsonl", range(1, 3), range(1, 2))


def test_help_lists_every_bench_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # help text wraps at the terminal width
    bench = out[out.index("bench benchmarks"):]
    assert all(name in bench for name in ("kernels", "rollout", "step", "study")), bench


def test_an_option_typo_gets_the_commands_usage_and_the_closest_option(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["quantize", "m", "--out", "o", "--ovewrite"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: qerl quantize" in err and "--ovewrite: did you mean --overwrite?" in err, err


def test_help_config_into_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "qerl.cli", "train", "--help-config"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `| head` that has read enough
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_train_says_what_it_does_before_the_first_step_and_keeps_each_step_to_one_line(tiny_dir, data_file, tmp_path,
                                                                                      capsys):
    out = tmp_path / "run"
    args = {"model.name": str(tiny_dir), "data.train": str(data_file), "data.max_prompt_tokens": 32,
            "data.suffix": "none", "rollout.prompts_per_step": 4, "rollout.group_size": 2,
            "rollout.max_new_tokens": 4, "lora.r": 4, "lora.alpha": 8, "steps": 2, "output_dir": str(out),
            "tensorboard": False, "plots": False, "reward_timeout_s": 30, "rewards": "[tiny_rewards:digit_reward]"}
    assert main(["train", *(f"{k}={v}" for k, v in args.items())]) == 0
    lines = capsys.readouterr().err.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("step 1 "))
    before = "\n".join(lines[:first])
    assert "loading" in before and "quantizing it to nvfp4" in before and "model ready" in before
    assert "14 linear layers" in before and "step 1: sampling 8 completions" in before
    assert "2 problems, fewer than rollout.prompts_per_step (4)" in before
    steps = [line for line in lines if line.startswith("step ") and "reward" in line]
    assert len(steps) == 2 and all("entropy" in line and line.endswith("GB") and len(line) <= 100 for line in steps)


def test_errors_name_the_option(tmp_path):
    from qerl.data import DatasetError, load_problems
    from qerl.rewards.runner import _call_inline, check_values

    for item, key in (("data.limit=0", "data.limit"), ("seed=-1", "seed")):
        with pytest.raises(ConfigError, match=rf"^{key}"):
            load_config(None, [item])
    with pytest.raises(DatasetError, match="is a directory; give a .jsonl, .json or .parquet file"):
        load_problems(str(tmp_path))
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "1+1", "gold": "2"}) + "\n")
    with pytest.raises(DatasetError, match=r"data\.answer_key=COLUMN"):
        load_problems(str(tmp_path / "d.jsonl"))
    status, values = _call_inline(lambda prompts, completions, **c: "1.0", ["p"], ["c"], {})
    assert check_values(values, 1)[2] == "returned a str ('1.0'), expected a list of 1 values"


def test_saved_files_get_the_umasks_permissions(tmp_path):
    from tiny import tiny_model

    from qerl.models import add_lora, quantize_model, save_adapter
    from qerl.nn.lora import LoraConfig

    model = tiny_model("llama")
    quantize_model(model, "nvfp4")
    add_lora(model, LoraConfig(r=4, alpha=8.0))
    mask = os.umask(0o022)
    try:
        out = save_adapter(model, tmp_path / "adapter", base_model_name_or_path="x")
    finally:
        os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in Path(out).iterdir()}
    assert set(modes.values()) == {0o644}, modes  # safetensors alone writes 0600
