"""`--resume` on what a user really has: another directory to continue in, a metrics file cut short, a corrupt
adapter in the newest checkpoint, no --config at hand, an override where the checkpoint's path would go, and
a directory whose metrics.jsonl is the user's own."""


import pytest

from qerl.cli import main
from qerl.rl.run_log import read_metrics

from tiny import tiny_run_args, write_arith


@pytest.fixture
def data_file(tmp_path):
    return write_arith(tmp_path / "arith.jsonl")


def _train(tiny_dir, data_file, out, **extra):
    return ["train", *tiny_run_args(tiny_dir, data_file, out, **{"rewards": "[tiny_rewards:digit_reward]", **extra})]


def _steps(run):
    return [m["step"] for m in read_metrics(run / "metrics.jsonl")]


def test_resume_a_checkpoint_into_a_new_directory(tiny_dir, data_file, tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    assert main(_train(tiny_dir, data_file, old)) == 0
    before = (old / "metrics.jsonl").read_text()
    capsys.readouterr()
    # no --config: the checkpoint's run's config.yaml; steps (future only) may change
    assert main(["train", "--resume", str(old / "checkpoints" / "step-000001"), "--output-dir", str(new),
                 "steps=3"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert f"the run's own {old / 'config.yaml'}" in err and "resumed from" in err
    assert _steps(new) == [1, 2, 3] and read_metrics(new / "metrics.jsonl")[0] == read_metrics(old / "metrics.jsonl")[0]
    assert (new / "adapter" / "adapter_model.safetensors").is_file()
    assert (old / "metrics.jsonl").read_text() == before  # the old run is left as it was
    # a directory that holds another run is refused, as a new run there would be
    assert main(["train", "--resume", str(old / "checkpoints" / "step-000001"), "--output-dir", str(new)]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_resume_without_config_reads_the_runs_config_and_takes_an_override_after_resume(tiny_dir, data_file, tmp_path,
                                                                                          capsys):
    run = tmp_path / "run"
    assert main(_train(tiny_dir, data_file, run)) == 0
    capsys.readouterr()
    # `--resume steps=3`: an override, not a checkpoint path; the run's settings are not compared with the defaults
    assert main(["train", "--output-dir", str(run), "--resume", "steps=3"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "the run's own" in err and "steps: 2 -> 3" in err
    assert _steps(run) == [1, 2, 3]


def test_a_cut_metrics_file_is_named_on_resume(tiny_dir, data_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_train(tiny_dir, data_file, run, steps=3)) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(lines[0] + lines[2])  # step 2's row lost
    capsys.readouterr()
    assert main(["train", "--output-dir", str(run), "--resume", "steps=4"]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl: no line for step 2 of the 3 before the checkpoint" in err, err
    assert _steps(run) == [1, 3, 4]  # the rows after the checkpoint are the resumed run's


def test_a_corrupt_adapter_in_the_newest_checkpoint_falls_back_to_the_previous_one(tiny_dir, data_file, tmp_path,
                                                                                   capsys):
    run = tmp_path / "run"
    assert main(_train(tiny_dir, data_file, run)) == 0
    weights = run / "checkpoints" / "step-000002" / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short
    capsys.readouterr()
    assert main(["train", "--resume", str(weights.parent.parent), "--output-dir", str(run)]) == 2  # named: refused
    err = capsys.readouterr().err
    assert "adapter_model.safetensors: corrupt or truncated" in err and "name an intact checkpoint" in err
    assert "Traceback" not in err
    assert main(["train", "--output-dir", str(run), "--resume"]) == 0  # auto: the newest intact one
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "falling back to the one before" in err
    assert f"resumed from {run / 'checkpoints' / 'step-000001'} at step 1" in err
    assert _steps(run) == [1, 2]


def test_a_users_metrics_file_is_not_taken_for_a_run(tiny_dir, data_file, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text('{"loss": 0.5, "epoch": 1}\n')
    for extra in ([], ["--resume"]):
        assert main([*_train(tiny_dir, data_file, mine), *extra]) == 2
        err = capsys.readouterr().err
        assert "metrics.jsonl" in err and "qerl did not write" in err and "pass --resume" not in err, err
        assert "Traceback" not in err
    assert (mine / "metrics.jsonl").read_text() == '{"loss": 0.5, "epoch": 1}\n'
    assert sorted(p.name for p in mine.iterdir()) == ["metrics.jsonl"]
