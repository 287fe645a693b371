"""A run directory has one writer and nothing non-finite: two runs started together into one output_dir, an
output path that is one of the command's own inputs, an unwritable path, an absurd learning rate and a run
whose update made its weights NaN each end with one line, a non-zero exit and nothing lost."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from qerl.cli import main
from qerl.config import ConfigError, load_config
from qerl.rl.run_log import read_metrics
from qerl.rl.trainer import Trainer

from tiny import tiny_run_args, write_arith

# A reward that takes its time, so that a run lasts long enough for a second one to start beside it.
LOCK_FILE = ".qerl-lock"  # qerl.models.run_lock.LOCK_FILE; spelled here so each test fails on its own

SLOW_REWARD = textwrap.dedent('''
    import time


    def slow_digits(prompts, completions, **columns):
        time.sleep(1.0)
        return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
''')


@pytest.fixture
def data_file(tmp_path):
    return write_arith(tmp_path / "arith.jsonl")


def _overrides(tiny_dir, data_file, out, **extra):
    return tiny_run_args(tiny_dir, data_file, out, **{"rewards": "[tiny_rewards:digit_reward]", **extra})


def _env(*paths):
    here = str(Path(__file__).parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), here, os.environ.get("PYTHONPATH", "")])}


# one writer ------------------------------------------------------------------------------------------------------


def test_two_runs_started_together_into_one_directory_one_is_refused(tiny_dir, data_file, tmp_path):
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "qerl.cli", "train",
            *_overrides(tiny_dir, data_file, out, steps=4, rewards="[slow_reward:slow_digits]")]
    procs = [subprocess.Popen([*args, f"seed={seed}"], env=_env(tmp_path), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "is writing a run there now" in refused and "Traceback" not in refused, refused
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]  # each step once
    winner = next(seed for seed, (code, _) in zip((1, 2), results) if code == 0)
    assert load_config(out / "config.yaml").seed == winner  # the refused run wrote nothing
    assert not (out / LOCK_FILE).exists()  # released at the end


def test_a_lock_is_refused_while_held_released_on_a_refusal_and_taken_over_from_a_dead_holder(
        tiny_dir, data_file, tmp_path, capsys):
    from qerl.models.run_lock import RunLock

    run = tmp_path / "run"
    with RunLock(run):
        with pytest.raises(FileExistsError, match=rf"process {os.getpid()} on .* is writing a run there now"):
            RunLock(run).acquire()
    assert not run.exists()  # made for the lock and empty again: removed
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run.mkdir()
    import socket

    (run / LOCK_FILE).write_text(f"{dead.pid} {socket.gethostname()}\n")  # what a kill -9 leaves
    lock = RunLock(run).acquire()
    assert f"taken over from process {dead.pid}, which is no longer running" in lock.stale_note
    lock.release()
    # a run refused after taking the lock (its data) releases it and leaves nothing behind
    out = tmp_path / "refused"
    assert main(["train", *_overrides(tiny_dir, data_file, out, **{"data.question_key": "nope"})]) == 2
    assert "nope" in capsys.readouterr().err
    assert not out.exists()
    with RunLock(out):
        pass


# outputs apart from inputs, writable ----------------------------------------------------------------------------


def test_quantize_refuses_to_overwrite_its_own_input(tiny_dir, tmp_path, capsys):
    import shutil

    model = tmp_path / "m"
    assert main(["quantize", str(tiny_dir), "--out", str(model), "--no-check"]) == 0
    shutil.rmtree(model)  # a qerl-written 16-bit model: a merged one, as `qerl merge` leaves it
    shutil.copytree(tiny_dir, model)
    (model / ".qerl-output.json").write_text('{"kind": "merged model"}\n')
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    for out in (model, model / "q"):
        assert main(["quantize", str(model), "--out", str(out), "--overwrite", "--no-check"]) == 2
        err = capsys.readouterr().err
        assert "the input model" in err and "choose an output path apart from model" in err, err
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_eval_refuses_to_overwrite_its_own_dataset(tiny_dir, tmp_path, capsys):
    results = tmp_path / "results.jsonl"  # an earlier eval's results, read back as a dataset
    results.write_text(json.dumps({"question": "1+1=?", "answer": "2", "completions": ["2"], "rewards": [1.0]}) + "\n")
    before = results.read_text()
    assert main(["eval", str(tiny_dir), "--dataset", str(results), "--out", str(results), "--overwrite"]) == 2
    assert "is the input --dataset" in capsys.readouterr().err
    assert results.read_text() == before


@pytest.mark.parametrize("command", ["train", "quantize", "merge", "eval"])
@pytest.mark.parametrize("root", ["/proc", "/sys"])
def test_an_unwritable_output_path_is_refused_before_any_work(command, root, tiny_dir, data_file, tmp_path, capsys):
    # root passes every permission check (os.access), yet the write itself fails there
    if not Path(root).is_dir():
        pytest.skip(f"no {root} here")
    out = f"{root}/qerl-out"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_dir)}))
    argv = {"train": ["train", *_overrides(tiny_dir, data_file, out)],
            "quantize": ["quantize", str(tiny_dir), "--out", out],
            "merge": ["merge", str(adapter), "--out", out],
            "eval": ["eval", str(tiny_dir), "--dataset", str(data_file), "--out", out + ".jsonl"]}[command]
    t0 = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err
    what = "output_dir" if command == "train" else "--out"
    assert err.startswith(f"error: {what} {out}") and f"cannot write in {root}" in err, err
    assert "Traceback" not in err and "loaded" not in err and "loading" not in err
    assert time.perf_counter() - t0 < 10


# finite values ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("item", ["optim.lr=inf", "optim.lr=5", "optim.max_grad_norm=inf",
                                  "rollout.temperature=.inf", "reward_weights=[1.0, inf]", "optim.weight_decay=3",
                                  "aqn.sigma_start=2", "aqn.sigma_end=1.5", "rollout.temperature=50",
                                  "algo.kl_beta=100", "algo.clip_high=20"])
def test_infinite_or_absurd_hyper_parameters_are_refused_with_the_config_checks(item):
    with pytest.raises(ConfigError, match=item.split("=")[0].replace(".", r"\.")):
        load_config(None, [item, "rewards=[a, b]"] if item.startswith("reward_weights") else [item])


def test_an_update_that_makes_the_weights_non_finite_stops_the_run_keeping_the_last_finite_checkpoint(
        tiny_dir, data_file, tmp_path):
    from safetensors.torch import load_file

    from qerl.rl.stop import TrainingAborted

    out = tmp_path / "run"
    Trainer(load_config(None, _overrides(tiny_dir, data_file, out, steps=2))).train()  # finite, checkpointed
    adapter = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    trainer = Trainer(load_config(out / "config.yaml", ["steps=4"]), resume="auto")
    # a rate the config checks refuse (optim.lr=inf), here reached past them: the run-time rule must hold
    trainer.scheduler.base_lrs = [float("inf")] * len(trainer.scheduler.base_lrs)
    for group in trainer.optimizer.param_groups:
        group["lr"] = float("inf")
    with pytest.raises(TrainingAborted) as raised:
        trainer.train()
    message = str(raised.value)
    assert "step 3's update made" in message and "NaN or Inf" in message and "step-000002" in message, message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]  # none after
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter
    weights = load_file(out / "checkpoints" / "step-000002" / "adapter" / "adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (out / LOCK_FILE).exists()


def test_a_non_finite_adapter_is_never_saved_and_eval_refuses_one(tiny_dir, data_file, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from qerl.models import add_lora, save_adapter
    from qerl.models.loader import ModelSpec, load_policy
    from qerl.models.lora_attach import lora_parameters
    from qerl.nn.lora import LoraConfig

    model, _ = load_policy(ModelSpec(name=str(tiny_dir), format="nvfp4", device="cpu"))
    add_lora(model, LoraConfig(r=4, alpha=8.0))
    adapter = tmp_path / "adapter"
    save_adapter(model, adapter, base_model_name_or_path=str(tiny_dir))
    with torch.no_grad():
        next(iter(lora_parameters(model).values()))[0, 0] = float("inf")
    with pytest.raises(ValueError, match="hold NaN or Inf"):
        save_adapter(model, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    weights = load_file(adapter / "adapter_model.safetensors")  # what an older qerl could have written
    weights[next(iter(weights))][0, 0] = float("nan")
    save_file(weights, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    assert main(["eval", str(tiny_dir), "--adapter", str(adapter), "--dataset", str(data_file), "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert "hold NaN or Inf" in err and "loaded" not in err
    # nor does a run start from one (model.adapter), and it says so before the model loads
    assert main(["train", *_overrides(tiny_dir, data_file, tmp_path / "run", **{"model.adapter": str(adapter)})]) == 2
    err = capsys.readouterr().err
    assert "model.adapter: " in err and "hold NaN or Inf" in err and "model ready" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_lock_is_taken_when_another_run_makes_the_directory_first(tmp_path, monkeypatch):
    """Two runs started together both find no output_dir: the one whose mkdir loses the race still locks (and,
    not having made the directory, never removes it); seen as "[Errno 17] File exists" on a 2-core machine."""
    from qerl.models.run_lock import RunLock

    out = tmp_path / "run"
    real_mkdir = Path.mkdir

    def beaten_to_it(self, *args, **kwargs):  # the other run's mkdir lands between our look and ours
        if self == out:
            real_mkdir(self)
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", beaten_to_it)
    lock = RunLock(out).acquire()
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    try:
        assert (out / ".qerl-lock").is_file()
    finally:
        lock.release()
    assert out.is_dir()  # the other run's directory stays
