"""A new user's mistakes, each refused in seconds with one line and nothing lost: output paths (--overwrite
replaces only what qerl wrote), --resume with changed settings, a reward that never scored, the `####`
answer, named options, reward modules in the current directory, range checks, stop signals, and the smaller
edges (model-name typos, a damaged cache, a truncated GGUF, an adapter of another base, library noise)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import yaml

from qerl.cli import main

from tiny import tiny_run_args, write_arith

USER_FILES = {"thesis.txt": "four years of work", "figures/plot.txt": "data"}


def _user_dir(path):
    for name, text in USER_FILES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def _assert_untouched(path):
    assert {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} == set(USER_FILES)
    for name, text in USER_FILES.items():
        assert (path / name).read_text() == text


def _evaluate_module():
    import importlib

    return importlib.import_module("qerl.eval.evaluate")  # the package exports a function of that name


@pytest.fixture
def no_model_load(monkeypatch):
    """Every way a command loads a model fails the test: a refusal must come before."""
    import qerl.models
    import qerl.models.pretrained
    import qerl.models.stream
    import qerl.rl.trainer

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    for module, name in ((qerl.models, "load_causal_lm"), (qerl.models.pretrained, "load_causal_lm"),
                         (qerl.models.pretrained, "plain_hf_directory"), (qerl.models.stream, "build_from"),
                         (qerl.rl.trainer, "build_policy"), (_evaluate_module(), "prepare_model")):
        monkeypatch.setattr(module, name, loaded)


@pytest.fixture
def data_file(tmp_path):
    return write_arith(tmp_path / "arith.jsonl")


def _train_args(tiny_dir, data_file, out, **extra):
    return ["train", *tiny_run_args(tiny_dir, data_file, out, **extra)]


# 1. output directories: --overwrite replaces only what qerl wrote -----------------------------------------------


@pytest.mark.parametrize("command", ["quantize", "merge"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_overwrite_never_deletes_a_directory_of_the_users_files(command, overwrite, tiny_dir, tmp_path, no_model_load,
                                                                capsys):
    target = _user_dir(tmp_path / "mine")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_dir)}))
    argv = {"quantize": ["quantize", str(tiny_dir), "--out", str(target), "--no-check"],
            "merge": ["merge", str(adapter), "--out", str(target)]}[command]
    assert main(argv + ["--overwrite"] * overwrite) == 2
    err = " ".join(capsys.readouterr().err.split())
    if overwrite:
        assert "holds files qerl did not write (figures/, thesis.txt)" in err
    else:
        assert "already exists" in err
    _assert_untouched(target)


def test_overwrite_replaces_what_qerl_wrote_with_normal_permissions(tiny_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(tiny_dir), "--out", str(out), "--no-check"]) == 0
    marker = json.loads((out / ".qerl-output.json").read_text())
    assert marker["kind"] == "quantized model"
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # not the temp directory's 0700
    assert json.loads((out / "config.json").read_text())["qerl_source_model"] == str(tiny_dir)
    assert main(["quantize", str(tiny_dir), "--out", str(out), "--no-check"]) == 2  # exists, no --overwrite
    assert "already exists" in capsys.readouterr().err
    assert main(["quantize", str(tiny_dir), "--out", str(out), "--no-check", "--format", "mxfp4", "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert (out / ".qerl-output.json").is_file()


def test_an_output_path_under_a_file_is_refused_before_the_model_loads(tiny_dir, tmp_path, no_model_load, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["quantize", str(tiny_dir), "--out", str(tmp_path / "afile" / "q")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


# 2. eval --out: checked before the evaluation, written atomically, never over a user's file -----------------------


def test_eval_out_is_checked_before_the_model_loads(tiny_dir, data_file, tmp_path, no_model_load, capsys):
    assert main(["eval", str(tiny_dir), "--dataset", str(data_file), "--out", str(tmp_path)]) == 2
    assert "is a directory; give a file path" in capsys.readouterr().err
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"my": "notes"}\n')
    for extra in ([], ["--overwrite"]):
        assert main(["eval", str(tiny_dir), "--dataset", str(data_file), "--out", str(notes), *extra]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "already exists" in err and "is not a file qerl wrote" in err
    assert notes.read_text() == '{"my": "notes"}\n'


def test_eval_out_overwrites_its_own_results_atomically(tiny_dir, data_file, tmp_path, capsys):
    from qerl.eval.evaluate import is_eval_output

    out = tmp_path / "res.jsonl"
    argv = ["eval", str(tiny_dir), "--dataset", str(data_file), "--limit", "2", "--n", "1", "--max-new-tokens", "2",
            "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    assert is_eval_output(out) and len(out.read_text().splitlines()) == 2
    assert main(argv + ["--overwrite", "--limit", "3"]) == 0
    assert len(out.read_text().splitlines()) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".res.jsonl.tmp")]


# 3. --resume: settings that shaped the earlier steps change only when named -------------------------------------


@pytest.fixture
def two_step_run(tiny_dir, data_file, tmp_path):
    out = tmp_path / "run"
    assert main(_train_args(tiny_dir, data_file, out)) == 0
    return out


def test_resume_refuses_changed_settings_before_the_model_loads(tiny_dir, data_file, two_step_run, no_model_load,
                                                               capsys):
    before = (two_step_run / "config.yaml").read_text()
    argv = _train_args(tiny_dir, data_file, two_step_run, steps=3, **{"rollout.group_size": 8, "optim.lr": 0.5,
                                                                     "rewards": "[format]"})
    assert main(argv + ["--resume"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    for change in ("rollout.group_size: run 2, now 8", "optim.lr: run 1e-05, now 0.5",
                   "rewards: run ['math'], now ['format']"):
        assert change in err, change
    assert "--resume --override rollout.group_size optim.lr rewards" in err
    assert (two_step_run / "config.yaml").read_text() == before  # the record still describes the run
    # naming only some of them is not enough; an override of an unchanged or unknown key is refused
    assert main(argv + ["--resume", "--override", "optim.lr"]) == 2
    assert main(_train_args(tiny_dir, data_file, two_step_run, steps=3) + ["--resume", "--override", "optim.lr"]) == 2
    assert "does not change it" in capsys.readouterr().err
    assert main(_train_args(tiny_dir, data_file, two_step_run, steps=3) + ["--resume", "--override", "optim.lrr"]) == 2
    assert "no such config key" in capsys.readouterr().err


def test_resume_records_future_only_and_overridden_changes_with_their_step(tiny_dir, data_file, two_step_run):
    argv = _train_args(tiny_dir, data_file, two_step_run, steps=3, **{"optim.lr": 2e-5})
    assert main(argv + ["--resume", "--override", "optim.lr"]) == 0
    changes = [json.loads(x) for x in (two_step_run / "config_changes.jsonl").read_text().splitlines()]
    assert changes == [{"step": 2, "key": "optim.lr", "from": 1e-05, "to": 2e-05, "override": True},
                       {"step": 2, "key": "steps", "from": 2, "to": 3, "override": False}]
    saved = yaml.safe_load((two_step_run / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 2e-05 and saved["steps"] == 3


def test_a_new_run_into_an_existing_run_is_refused_before_the_model_loads(tiny_dir, data_file, two_step_run,
                                                                         no_model_load, capsys):
    assert main(_train_args(tiny_dir, data_file, two_step_run)) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err


# 4. a reward that never scored a row fails the run, whatever its length ----------------------------------------


def test_a_reward_that_failed_on_every_row_of_a_short_run_exits_non_zero(tiny_dir, data_file, tmp_path, monkeypatch,
                                                                         capsys):
    from safetensors import safe_open

    (tmp_path / "broken_rewards.py").write_text("def fails(prompts, completions, **c):\n    raise KeyError('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    # 2 steps, under max_reward_failure_steps (3): before, exit 0 and an adapter trained on nothing
    assert main(_train_args(tiny_dir, data_file, out, rewards="['broken_rewards:fails']")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "failed on every row of every step (1-2)" in err and "KeyError" in err
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert "failed on every row" in f.metadata()["qerl_warning"]


# 5. the answer after `####` ------------------------------------------------------------------------------------

# (completion, reference, math reward, format reward): what a model writes after the marker
COMPLETIONS = [
    ("3 bags of 6 apples.\n#### 18 (3 bags of 6)", "18", 1.0, 1.0),
    ("Each costs $5, so 5 x 4 = 20.\n#### 20", "20", 1.0, 1.0),
    ("She pays 1,250.50 in total.\n#### $1,250.50", "1250.5", 1.0, 1.0),
    ("#### **42**", "42", 1.0, 1.0),
    ("Half of it.\n#### 3/4 of a cup", "0.75", 1.0, 1.0),
    ("Loss of 5.\n#### -5", "-5", 1.0, 1.0),
    ("#### 7 dollars", "7", 1.0, 1.0),
    ("#### 18.", "18", 1.0, 1.0),
    ("#### The answer is 18", "18", 1.0, 1.0),  # no number right after the marker: the line's last number
    ("#### \\frac{1}{2}", "0.5", 1.0, 1.0),
    ("#### 6 (3 bags of 6 makes 18)", "18", 0.0, 1.0),  # the committed answer is 6, whatever follows
    ("First #### 12, then I checked: #### 14", "14", 1.0, 1.0),  # the last marker counts
    ("#### 14\nWait, that is wrong, it is 15.", "15", 0.0, 0.0),
    ("So the answer is 18.", "18", 1.0, 0.0),  # no marker: flexible extraction, and no format reward
]


@pytest.mark.parametrize("completion,reference,correct,formatted", COMPLETIONS)
def test_the_number_right_after_the_marker_is_the_answer(completion, reference, correct, formatted):
    from qerl.rewards import format_reward, math_reward

    assert math_reward([""], [completion], answer=[reference]) == [correct]
    assert format_reward([""], [completion]) == [formatted]


# 6. named options: a typo is refused with "did you mean", literal text needs text: ----------------------------


def test_a_suffix_typo_is_refused_with_did_you_mean(tiny_dir, data_file, tmp_path, no_model_load, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", str(tiny_dir), "--dataset", str(data_file), "--suffix", "gsm8K"])
    assert e.value.code == 2
    assert "did you mean 'gsm8k'?" in capsys.readouterr().err
    assert main(_train_args(tiny_dir, data_file, tmp_path / "r", **{"data.suffix": "boxd"})) == 2
    assert "data.suffix: unknown suffix 'boxd': did you mean 'boxed'?" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "r").exists()


def test_literal_suffix_text_needs_its_prefix():
    from qerl.data.templates import GSM8K_SUFFIX, build_prompt, resolve_suffix

    assert build_prompt("2+2?", suffix="text:Answer with a number.") == "2+2?\nAnswer with a number.\n"
    assert resolve_suffix("gsm8k") == resolve_suffix(GSM8K_SUFFIX) == GSM8K_SUFFIX
    with pytest.raises(ValueError, match="text:<your text>"):
        resolve_suffix("Answer with a number.")


# 7. a reward module in the current directory imports under the `qerl` script too -------------------------------


def test_a_reward_module_in_the_current_directory_imports(tmp_path, monkeypatch):
    from qerl.rewards.resolve import resolve_reward

    (tmp_path / "myrewards.py").write_text("def short(prompts, completions, **c):\n"
                                           "    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    # the `qerl` console script's sys.path starts at its bin/ directory: no "" and no current directory
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert resolve_reward("myrewards:short")(["p"], ["c"]) == [1.0]
    assert sys.path[-1] == str(tmp_path)  # appended: a local file never shadows an installed package
    with pytest.raises(ValueError, match=r"No module named 'nothere'.*current directory .* PYTHONPATH"):
        resolve_reward("nothere:f")


# 8-9. range checks and early refusals: usage errors, never tracebacks ------------------------------------------


@pytest.mark.parametrize("option,value", [("--n", "0"), ("--batch-size", "0"), ("--max-new-tokens", "0"),
                                          ("--top-p", "0"), ("--temperature", "-1"), ("--max-bad-fraction", "2"),
                                          ("--limit", "-3"), ("--n", "two")])
def test_eval_numbers_are_range_checked_before_anything_runs(option, value, tiny_dir, data_file, no_model_load,
                                                             capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", str(tiny_dir), "--dataset", str(data_file), option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "Traceback" not in err


def test_quantize_numbers_are_range_checked(tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["quantize", str(tiny_dir), "--out", str(tmp_path / "q"), "--calibration-samples", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def _run_then(monkeypatch, action):
    """Make the model load (the slow part) do `action` instead."""
    monkeypatch.setattr(_evaluate_module(), "prepare_model", lambda args: action())


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_during_the_model_load_ends_with_one_line(signum, tiny_dir, data_file, tmp_path, monkeypatch,
                                                                 capsys, restore_signals):
    import time

    def signalled_twice():
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
        finally:  # a second signal while the first one unwinds: ignored, the clean-up finishes
            os.kill(os.getpid(), signum)
            time.sleep(0.05)
        raise AssertionError("not interrupted")

    _run_then(monkeypatch, signalled_twice)
    out = tmp_path / "res.jsonl"
    assert main(["eval", str(tiny_dir), "--dataset", str(data_file), "--out", str(out)]) == 128 + signum
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"stopped by {signal.Signals(signum).name}" in err
    assert not out.exists()


# 10. the smaller edges ------------------------------------------------------------------------------------------


def test_a_model_name_typo_gets_did_you_mean_at_once(no_model_load):
    from qerl.models.pretrained import check_near_miss
    from qerl.models.sources import ModelLoadError

    with pytest.raises(ModelLoadError, match="did you mean 'smollm2-135m-instruct'"):
        check_near_miss("smollm2-135m")
    check_near_miss("gpt2")  # a hub id of the old form: the hub decides
    check_near_miss("Qwen/Qwen2.5-7B-Instruct")


def test_cli_names_a_model_typo_without_asking_the_hub(data_file, capsys, monkeypatch):
    import huggingface_hub

    def hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub)
    assert main(["eval", "smollm2-135m", "--dataset", str(data_file), "--limit", "1"]) == 2
    assert "did you mean 'smollm2-135m-instruct'" in capsys.readouterr().err


def _counted_conversions(tmp_path, monkeypatch) -> list:
    """The embedded GGUF conversion replaced by a tiny model, into a cache under tmp_path; returns the list each
    conversion appends its path to."""
    from tiny import tiny_model, tiny_tokenizer

    from qerl.models import registry

    conversions = []

    def fake_gguf_load(path):
        conversions.append(path)
        return tiny_model("llama"), tiny_tokenizer()

    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "embedded_gguf", lambda name: tmp_path / f"{name}.gguf")
    monkeypatch.setattr(registry, "load_gguf", fake_gguf_load)
    return conversions


def test_a_damaged_cached_model_is_rebuilt(tmp_path, monkeypatch):
    from qerl.models import registry

    conversions = _counted_conversions(tmp_path, monkeypatch)
    target = registry.embedded_hf_dir("smollm2-135m-instruct")
    weights = next(target.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # a disk that filled up mid-copy
    assert registry.embedded_hf_dir("smollm2-135m-instruct") == target
    assert len(conversions) == 2
    from qerl.models.sources import check_safetensors

    check_safetensors(target)


def test_a_cached_directory_whose_tokenizer_names_another_eos_is_rebuilt(tmp_path, monkeypatch):
    from qerl.models import registry

    conversions = _counted_conversions(tmp_path, monkeypatch)
    target = registry.embedded_hf_dir("smollm2-135m-instruct")
    assert registry.embedded_hf_dir("smollm2-135m-instruct") == target and len(conversions) == 1  # used as it is
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    config = json.loads((target / "config.json").read_text())
    vocab = json.loads((target / "tokenizer.json").read_text())["added_tokens"]
    other = next(t["content"] for t in vocab if t["id"] != config["eos_token_id"])
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": other}))
    assert registry.embedded_hf_dir("smollm2-135m-instruct") == target and len(conversions) == 2
    registry.check_tokenizer_eos(target)


def test_an_adapter_of_another_base_gets_a_warning(tiny_dir, data_file, tmp_path, monkeypatch, capsys):
    from qerl.models.adapter import adapter_base_mismatch

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-7B-Instruct"}))
    assert "was trained on 'Qwen/Qwen2.5-7B-Instruct'" in adapter_base_mismatch(adapter, str(tiny_dir))
    assert adapter_base_mismatch(adapter, "Qwen/Qwen2.5-7B-Instruct") is None
    quantized = tmp_path / "q"  # a quantized directory counts as the model it was made from
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({"qerl_source_model": "Qwen/Qwen2.5-7B-Instruct"}))
    assert adapter_base_mismatch(adapter, str(quantized)) is None

    def stop():
        raise ValueError("stop here")

    _run_then(monkeypatch, stop)
    assert main(["eval", str(tiny_dir), "--adapter", str(adapter), "--dataset", str(data_file)]) == 2
    assert "warning:" in capsys.readouterr().err


def test_library_import_noise_is_filtered(tmp_path):
    """The CLI's first words are its own: importing peft (which `qerl merge` does first) announces torchao's and
    bitsandbytes' missing native parts and torch pytree deprecations, four lines before every message."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    code = textwrap.dedent(f"""
        import sys
        import torch
        from safetensors.torch import save_file
        save_file({{"w": torch.zeros(1)}}, {str(adapter / "adapter_model.safetensors")!r})
        from qerl.cli import main
        sys.exit(main(["merge", {str(adapter)!r}, "--out", {str(tmp_path / "merged")!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no such file or directory" in lines[0], proc.stderr


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="SIGUSR1 is POSIX")
def test_sigusr1_prints_the_stacks_and_the_command_goes_on():
    code = textwrap.dedent("""
        import os, signal, time
        from qerl.cli import install_stack_dumps
        install_stack_dumps()
        def waiting_here():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.3)
            print("went on")
        waiting_here()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "went on", done.stderr
    assert "waiting_here" in done.stderr and "File" in done.stderr


@pytest.mark.parametrize("every", ["0.2", "-1", "soon", "inf", "1e300"])
def test_qerl_stacks_every_prints_the_stacks_without_a_signal(every):
    code = textwrap.dedent("""
        import time
        from qerl.cli import install_stack_dumps
        install_stack_dumps()
        def sleeping_in_c():
            time.sleep(0.7)
            print("went on")
        sleeping_in_c()
    """)
    env = {**os.environ, "QERL_STACKS_EVERY": every}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "went on", done.stderr
    if every == "0.2":  # about three dumps in 0.7 s, each naming the function the main thread sleeps in
        assert done.stderr.count("sleeping_in_c") >= 2, done.stderr
    else:
        assert "sleeping_in_c" not in done.stderr and "is not a number of seconds" in done.stderr


def test_the_watchdog_ends_with_the_command(monkeypatch, capfd):
    """main cancels QERL_STACKS_EVERY's repeating dump: a caller in the same process gets no dumps afterwards."""
    import time

    monkeypatch.setenv("QERL_STACKS_EVERY", "0.1")
    assert main(["train", "--help-config"]) == 0
    capfd.readouterr()
    time.sleep(0.35)
    assert "most recent call first" not in capfd.readouterr().err
