"""A short end-to-end `qerl train` on a tiny random model: the loop, outputs, checkpoint and resume."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from qerl.cli import main
from qerl.config import load_config
from qerl.models import load_adapter, load_causal_lm
from qerl.rl.run_log import read_metrics
from qerl.rl.trainer import Trainer


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "arith.jsonl"
    rows = [{"question": f"{a}+{b}=?", "answer": str(a + b)} for a in range(1, 6) for b in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(tiny_dir, data_file, out, **extra):
    base = {"model.name": str(tiny_dir), "model.format": "nvfp4", "data.train": str(data_file),
            "data.max_prompt_tokens": 32, "data.suffix": "none", "rollout.prompts_per_step": 2, "rollout.group_size": 4,
            "rollout.max_new_tokens": 8, "lora.r": 4, "lora.alpha": 8, "optim.lr": 1e-3, "steps": 3,
            "output_dir": str(out), "tensorboard": False, "aqn.num_stages": 3, "aqn.sigma_start": 0.05,
            "aqn.sigma_end": 0.01, "reward_timeout_s": 30, "rewards": "[math, 'tiny_rewards:digit_reward']"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.mark.parametrize("algo", ["grpo", "dapo", "dr_grpo"])
def test_train_runs_and_writes_outputs(tiny_dir, data_file, tmp_path, algo):
    extra = {"algo.name": algo}
    if algo == "grpo":
        extra.update({"algo.kl_beta": 0.05, "algo.num_updates": 2})
    if algo == "dapo":
        extra.update({"algo.clip_high": 0.28, "algo.overlong_filter": True, "algo.overlong_buffer": 2})
    cfg = load_config(None, _overrides(tiny_dir, data_file, tmp_path / "run", **extra))
    trainer = Trainer(cfg)
    # model.dtype auto computes in float32 on the CPU (bf16 matmuls are ~100x slower there)
    assert trainer.model.model.norm.weight.dtype == torch.float32
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_B" in k}
    adapter = trainer.train()
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        for key in ("reward", "entropy", "aqn_sigma", "response_length", "tokens_per_s", "time_rollout",
                    "time_update", "memory_gb", "lr"):
            assert m[key] is not None, key
    updated = [m for m in metrics if "loss" in m]  # DAPO's filters may leave a step without an update
    assert updated and all(m["update_flops"] > 0 for m in updated)
    for m in updated:
        assert m["update_tflops"] == pytest.approx(m["update_flops"] / m["time_update"] / 1e12)
    assert [m["aqn_sigma"] for m in metrics] == pytest.approx([0.0, 0.05, 0.01])
    assert metrics[0]["entropy"] > 0
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert (tmp_path / "run" / "reward_sampled.png").is_file()
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no LoRA weight moved"
    model, _ = load_causal_lm(tiny_dir)
    from qerl.models import quantize_model

    quantize_model(model, "nvfp4")
    load_adapter(model, adapter)


def test_cli_train_and_resume(tiny_dir, data_file, tmp_path):
    out = tmp_path / "run"
    args = _overrides(tiny_dir, data_file, out, save_every=1, steps=2, keep_best="true")
    assert main(["train", *args]) == 0
    assert (out / "checkpoints" / "best" / "adapter" / "adapter_model.safetensors").is_file()
    first = read_metrics(out / "metrics.jsonl")
    assert len(first) == 2
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["rollout"]["group_size"] == 4
    # continue the same run for one more step
    assert main(["train", *_overrides(tiny_dir, data_file, out, save_every=1, steps=3), "--resume"]) == 0
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    # a second run into the same directory without --resume is refused
    assert main(["train", *args]) == 2


def test_compute_dtype_auto_is_bf16_on_a_gpu_and_float32_on_the_cpu():
    from qerl.models.sources import compute_dtype

    assert compute_dtype("auto", "cuda") == torch.bfloat16
    assert compute_dtype("auto", torch.device("cuda", 1)) == torch.bfloat16
    assert compute_dtype("auto", "cpu") == torch.float32
    assert compute_dtype(None, None) == torch.float32
    assert compute_dtype("bf16", "cpu") == torch.bfloat16 and compute_dtype("fp16", "cuda") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        compute_dtype("int8", "cpu")


def test_bad_config_is_refused(tiny_dir, data_file, tmp_path):
    assert main(["train", *_overrides(tiny_dir, data_file, tmp_path / "r"), "rollout.group_sise=4"]) == 2
    assert not (tmp_path / "r").exists()


def test_resume_refuses_a_different_model_setup_and_skips_a_broken_checkpoint(tiny_dir, data_file, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *_overrides(tiny_dir, data_file, out, save_every=1, steps=2)]) == 0
    # another LoRA rank than the checkpoint's: refused, naming the key
    with pytest.raises(ValueError, match=r"lora.r: checkpoint 4, now 8"):
        Trainer(load_config(None, _overrides(tiny_dir, data_file, out, steps=3, **{"lora.r": 8})), resume="auto")
    # the newest checkpoint is corrupt: --resume auto falls back to the previous one and says so
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["step-000001", "step-000002"]
    (checkpoints[-1] / "trainer_state.pt").write_bytes(b"garbage")
    trainer = Trainer(load_config(None, _overrides(tiny_dir, data_file, out, steps=3)), resume="auto")
    assert trainer.step == 1
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1]


def test_sigterm_finishes_the_step_checkpoints_and_resumes(tiny_dir, data_file, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    args = _overrides(tiny_dir, data_file, out, steps=200)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "qerl.cli", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "training produced no steps"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "continue with --resume" in err
    steps = [m["step"] for m in read_metrics(metrics)]
    saved = sorted((out / "checkpoints").iterdir())[-1]
    assert int(saved.name.split("-")[1]) == steps[-1]  # the step in flight finished and was checkpointed
    trainer = Trainer(load_config(None, _overrides(tiny_dir, data_file, out, steps=steps[-1] + 1)), resume="auto")
    assert trainer.step == steps[-1]


# wall-clock metrics, and time_to_first_step: on the first step of each process (a resumed run has it again)
TIMING_KEYS = ("tokens_per_s", "time_rollout", "time_generate", "time_update", "time_step", "memory_gb",
               "reward/time_s", "update_tflops", "time_to_first_step")


def _deterministic(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def _steps(run_dir):
    """A run's metrics without its wall-clock keys."""
    return _deterministic(read_metrics(run_dir / "metrics.jsonl"))


# A checkpoint after every step; dropout draws RNG. The runs are compared metric for metric, so no outcome may
# depend on the wall clock: a reward worker's first call imports its module (tiny: torch + transformers, ~2 s
# idle, far more on a loaded machine) inside the reward time limit, and one run timing out where another did
# not changes its rewards. The limit here only has to stop a hung test.
KILL_RUN = {"save_every": 1, "steps": 5, "lora.dropout": 0.1, "reward_timeout_s": 600}


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, data_file, tmp_path_factory):
    """The run every interrupted-and-resumed one must reproduce; read-only (tests copy from it)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert main(["train", *_overrides(tiny_dir, data_file, out, **KILL_RUN)]) == 0
    return out


def test_kill_9_then_resume_reproduces_the_uninterrupted_run(tiny_dir, data_file, tmp_path, uninterrupted):
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "qerl.cli", "train", *_overrides(tiny_dir, data_file, out, **KILL_RUN)]
    proc = subprocess.Popen(cmd,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while True:
        # whether it had ended is read before the file: a run that finishes (steps take milliseconds, so a
        # stalled test process can miss them all) between the two reads is then seen with all its lines
        ended = proc.poll() is not None
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 3:
            break
        assert not ended, proc.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # no handler runs: mid-step, maybe mid-checkpoint (or after the end)
    proc.wait()
    assert main(["train", *_overrides(tiny_dir, data_file, out, **KILL_RUN), "--resume"]) == 0
    assert _steps(out) == _steps(uninterrupted)


def _metric_lines(run: Path) -> list[str]:
    return (run / "metrics.jsonl").read_text().splitlines(keepends=True)


def test_killed_before_the_first_checkpoint_resume_starts_again(tiny_dir, data_file, tmp_path, uninterrupted, capsys):
    # what a kill while the first checkpoint is being written leaves (or any kill before the end with
    # save_every 0): a metrics line, a hidden partial checkpoint, no complete one. Before, --resume said "no
    # complete checkpoint" and a new run "already holds a run": the directory was stuck.
    out = tmp_path / "run"
    (out / "checkpoints" / ".step-000001.tmp-k9" / "adapter").mkdir(parents=True)
    (out / "metrics.jsonl").write_text(_metric_lines(uninterrupted)[0])
    assert main(["train", *_overrides(tiny_dir, data_file, out, **KILL_RUN), "--resume"]) == 0
    assert "no complete checkpoint yet: starting again from step 0" in " ".join(capsys.readouterr().err.split())
    assert _steps(out) == _steps(uninterrupted)
    # a directory that never held a run is still an error: a mistyped output_dir is not silently started
    assert main(["train", *_overrides(tiny_dir, data_file, tmp_path / "typo", **KILL_RUN), "--resume"]) == 2
    assert "no complete checkpoint to resume from" in " ".join(capsys.readouterr().err.split())


def test_a_metrics_line_cut_by_a_kill_is_redone_on_resume(tiny_dir, data_file, tmp_path, uninterrupted):
    # a kill (or a full disk) in the middle of appending step 5's line leaves half of it, no newline; the
    # resume from step 4's checkpoint used to fail parsing it ("Expecting property name ...")
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted / "checkpoints" / "step-000004", out / "checkpoints" / "step-000004")
    lines = _metric_lines(uninterrupted)
    (out / "metrics.jsonl").write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
    assert main(["train", *_overrides(tiny_dir, data_file, out, **KILL_RUN), "--resume"]) == 0
    assert _steps(out) == _steps(uninterrupted)


def test_truncate_metrics_drops_later_steps_and_an_unfinished_line(tmp_path):
    from qerl.rl.run_log import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    truncate_metrics(path, 3)  # no file yet: nothing to do
    assert not path.exists()
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3}\n{"st')
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1, "re')  # not even the first line finished
    truncate_metrics(path, 2)
    assert path.read_text() == ""
    # a finished line that is not JSON is not a kill's doing: named, not dropped
    path.write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON"):
        truncate_metrics(path, 2)


def test_non_finite_steps_are_skipped_counted_then_abort(tiny_dir, data_file, tmp_path):
    from qerl.models import lora_parameters
    from qerl.rl.trainer import TrainingAborted

    cfg = load_config(None, _overrides(tiny_dir, data_file, tmp_path / "run", **{"optim.max_bad_steps": 2, "steps": 5}))
    trainer = Trainer(cfg)
    good = trainer.train_step()
    assert good["skipped"] == 0
    name, p = next((n, p) for n, p in lora_parameters(trainer.model).items() if "lora_B" in n)
    saved = {n: q.detach().clone() for n, q in lora_parameters(trainer.model).items()}
    with torch.no_grad():
        p[0, 0] = float("nan")  # a poisoned adapter: every loss is NaN from now on
    bad = trainer.train_step()
    assert bad["skipped"] == 1 and bad["bad_steps_total"] == 1
    for n, q in lora_parameters(trainer.model).items():  # the optimizer did not step on the NaN
        if n != name:
            assert torch.equal(q, saved[n]), n
    with pytest.raises(TrainingAborted, match="2 steps in a row"):
        trainer.train_step()


def test_out_of_memory_names_the_knobs(tiny_dir, data_file, tmp_path, monkeypatch):
    from qerl.rl.trainer import TrainingAborted

    trainer = Trainer(load_config(None, _overrides(tiny_dir, data_file, tmp_path / "run")))

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(trainer, "train_step", oom)
    knob = (r"optim.max_tokens_per_micro_batch \(now 16384 by model size\), "  # a tiny model: the ceiling
            r"rollout.prompts_per_step x rollout.group_size")
    with pytest.raises(TrainingAborted, match=knob) as e:
        trainer.train()
    assert "release_kv_cache" not in str(e.value)  # on the CPU the engine is never kept
    trainer.engine_memory.keep = True  # as auto decides on a GPU where the engine fits
    with pytest.raises(TrainingAborted, match=r"kept through the update \(rollout.release_kv_cache=true frees"):
        trainer.train()
    padded = Trainer(load_config(None, _overrides(tiny_dir, data_file, tmp_path / "padded",
                                                  **{"optim.packing": False})))
    monkeypatch.setattr(padded, "train_step", oom)
    with pytest.raises(TrainingAborted, match=r"optim.micro_batch_size \(now \d+\), rollout.prompts_per_step"):
        padded.train()


def test_a_half_written_checkpoint_is_ignored(tiny_dir, data_file, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *_overrides(tiny_dir, data_file, out, save_every=1, steps=2)]) == 0
    # what a crash in the middle of writing step 3 leaves behind: a hidden temp directory, partly filled
    partial = out / "checkpoints" / ".step-000003.tmp-x1y2"
    (partial / "adapter").mkdir(parents=True)
    (partial / "trainer_state.pt").write_bytes(b"\0" * 10)
    trainer = Trainer(load_config(None, _overrides(tiny_dir, data_file, out, steps=3)), resume="auto")
    assert trainer.step == 2


def test_a_checkpoint_of_another_format_version_is_refused(tiny_dir, data_file, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *_overrides(tiny_dir, data_file, out, save_every=1, steps=1)]) == 0
    state_file = next((out / "checkpoints").glob("step-*")) / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    state["format_version"], state["qerl_version"] = 99, "9.9.9"
    torch.save(state, state_file)
    with pytest.raises(ValueError, match=r"checkpoint format 99 != 1 \(written by qerl 9.9.9\)"):
        Trainer(load_config(None, _overrides(tiny_dir, data_file, out, steps=2)), resume=str(state_file.parent))


def test_resume_check_reads_a_key_missing_from_an_older_checkpoint_as_its_old_meaning():
    import copy

    from qerl.config import TrainConfig, to_dict
    from qerl.rl.checkpointing import check_same_run

    current = to_dict(TrainConfig())
    saved = copy.deepcopy(current)
    del saved["model"]["quantize_embeddings"]  # written before the option existed
    check_same_run(saved, current, Path("ckpt"))
    current["model"]["quantize_embeddings"] = True
    with pytest.raises(ValueError, match=r"model.quantize_embeddings: checkpoint False, now True"):
        check_same_run(saved, current, Path("ckpt"))


def test_resume_check_compares_the_calibration_only_for_calibrated_methods():
    """The calibration text shapes a gptq / awq base only: an rtn run resumes whatever it says, a gptq run
    whose calibration differs (e.g. 128 sequences then, 64 now) is refused."""
    import copy

    from qerl.config import TrainConfig, to_dict
    from qerl.rl.checkpointing import check_same_run

    saved = to_dict(TrainConfig())
    saved["model"]["calibration"]["samples"] = 128
    current = copy.deepcopy(saved)
    current["model"]["calibration"]["samples"] = 64
    check_same_run(saved, current, Path("ckpt"))  # rtn
    for method in ("gptq", "awq"):
        saved["model"]["quant_method"] = current["model"]["quant_method"] = method
        with pytest.raises(ValueError, match=r"model.calibration: checkpoint .*'samples': 128.* now .*'samples': 64"):
            check_same_run(saved, current, Path("ckpt"))


def test_the_run_config_records_the_calibration_samples_used(tiny_dir, data_file, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(load_config(None, _overrides(tiny_dir, data_file, out, steps=1)))
    assert trainer.cfg.model.calibration.samples == 64  # null resolved for the CPU
    trainer.train()
    assert "samples: 64" in (out / "config.yaml").read_text()


def test_grad_input_no_temporary_pins_the_routing_on_every_quantized_layer(tiny_dir, data_file, tmp_path):
    """`optim.grad_input_no_temporary` reaches the backward through the layers (not a scope, which autograd's
    CUDA worker threads would not see); without it the layers follow the caller's scope."""
    from qerl.nn import QuantLinear

    def layers(trainer):
        return [m for m in trainer.model.modules() if isinstance(m, QuantLinear)]

    on = Trainer(load_config(None, _overrides(tiny_dir, data_file, tmp_path / "on",
                                              **{"optim.grad_input_no_temporary": True})))
    assert layers(on) and all(m.routing_policy.grad_input_no_temporary for m in layers(on))
    off = Trainer(load_config(None, _overrides(tiny_dir, data_file, tmp_path / "off")))
    assert all(m.routing_policy is None for m in layers(off))
