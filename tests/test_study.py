"""The multi-arm, multi-seed study (qerl.study, `qerl bench study`): arm parsing, aggregation,
skipping finished jobs, the deadline, and one real end-to-end run on a tiny model on the CPU."""

import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from qerl.study import arms as study_arms
from qerl.study import jobs as study_jobs
from qerl.study import report as study_report
from qerl.study import runner as study
from qerl.study.runner import Arm, Job, StudyError
from qerl.config import AQNSection, load_config

# arms and seeds -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text,arm", [
    ("bf16", Arm("bf16", False)),
    ("bf16+aqn", Arm("bf16", True)),
    ("nvfp4+aqn", Arm("nvfp4", True, "exponential")),
    ("nvfp4+aqn:exponential", Arm("nvfp4", True, "exponential")),
    ("nvfp4+aqn:linear", Arm("nvfp4", True, "linear")),
    (" nf4 ", Arm("nf4", False)),
    ("nvfp4@5e-4", Arm("nvfp4", False, lr=5e-4)),
    ("nvfp4-gptq+aqn:linear@0.0002", Arm("nvfp4", True, "linear", "gptq", 2e-4)),
    ("nvfp4+aqn=0.1", Arm("nvfp4", True, sigma=0.1)),
    ("nvfp4-awq+aqn=1e-1:cosine@1e-4", Arm("nvfp4", True, "cosine", "awq", 1e-4, 0.1)),
    ("nvfp4-awq/eora+aqn", Arm("nvfp4", True, method="awq", init="eora")),
    ("nf4/loftq", Arm("nf4", False, init="loftq")),
    ("nvfp4/zero", Arm("nvfp4", False)),
])
def test_parse_arm(text, arm):
    assert study_arms.parse_arm(text) == arm


def test_arm_names_and_overrides():
    assert study_arms.parse_arm("nvfp4+aqn:exponential").name == "nvfp4+aqn"
    arm = study_arms.parse_arm("nvfp4+aqn:cosine")
    assert (arm.name, arm.slug) == ("nvfp4+aqn:cosine", "nvfp4_aqn_cosine")
    assert arm.overrides() == ["model.format=nvfp4", "model.quant_method=rtn", "aqn.enabled=true", "aqn.decay=cosine"]
    assert study_arms.parse_arm("bf16").overrides()[2] == "aqn.enabled=false"
    arm = study_arms.parse_arm("nvfp4-gptq+aqn")
    assert (arm.name, arm.slug, arm.method) == ("nvfp4-gptq+aqn", "nvfp4-gptq_aqn", "gptq")
    assert "model.quant_method=gptq" in arm.overrides()
    assert study_arms.parse_arm("nvfp4-rtn").name == "nvfp4"
    arm = study_arms.parse_arm("nvfp4-gptq+aqn@0.0002")
    assert (arm.name, arm.slug) == ("nvfp4-gptq+aqn@0.0002", "nvfp4-gptq_aqn_lr0.0002")
    assert arm.overrides()[-1] == "optim.lr=0.0002"
    assert "optim.lr" not in " ".join(study_arms.parse_arm("bf16").overrides())


def test_an_arm_init_sets_lora_init():
    arm = study_arms.parse_arm("nvfp4-awq/eora+aqn")
    assert (arm.name, arm.slug) == ("nvfp4-awq/eora+aqn", "nvfp4-awq_eora_aqn")
    assert load_config(None, arm.overrides()).lora.init == "eora"
    assert "lora.init" not in " ".join(study_arms.parse_arm("nvfp4-awq+aqn").overrides())
    assert study_arms.parse_arm("nvfp4/zero").name == "nvfp4"


def test_an_arm_sigma_sets_the_aqn_schedule_at_the_papers_ratio():
    arm = study_arms.parse_arm("nvfp4-awq+aqn=0.1:linear@1e-4")
    assert (arm.name, arm.slug) == ("nvfp4-awq+aqn=0.1:linear@0.0001", "nvfp4-awq_aqn-s0.1_linear_lr0.0001")
    cfg = load_config(None, arm.overrides())
    got = (cfg.aqn.sigma_start, cfg.aqn.sigma_end, cfg.aqn.decay, cfg.optim.lr)
    assert got == (0.1, pytest.approx(5e-3), "linear", 1e-4)
    default = load_config(None, study_arms.parse_arm("nvfp4+aqn").overrides())
    assert (default.aqn.sigma_start, default.aqn.sigma_end) == (AQNSection.sigma_start, AQNSection.sigma_end)


@pytest.mark.parametrize("text,match", [
    ("fp6", "unknown format"),
    ("nvfp4:linear", "only makes sense with AQN"),
    ("nvfp4+aqn:steep", "unknown AQN decay"),
    ("nvfp4+noise", "expected FORMAT"),
    ("nvfp4-best", "unknown quantization method"),
    ("NVFP4", "expected FORMAT"),
    ("nvfp4@", "expected FORMAT"),
    ("nvfp4@2", "must be a number in"),
    ("nvfp4@1e-4e", "must be a number in"),
    ("nvfp4+aqn=0", "AQN sigma '0' must be a number in"),
    ("nvfp4+aqn=-1e-2", "AQN sigma"),
    ("nvfp4+aqn=", "expected FORMAT"),
    ("nvfp4=0.1", "expected FORMAT"),
    ("nvfp4/pissa", "unknown adapter init"),
    ("bf16/eora", "a bf16 base has none"),
    ("nvfp4+aqn/eora", "expected FORMAT"),
    ("", "expected FORMAT"),
])
def test_parse_arm_refuses(text, match):
    with pytest.raises(StudyError, match=match):
        study_arms.parse_arm(text)


def test_parse_arms_and_seeds():
    assert [a.name for a in study.parse_arms("nvfp4+aqn,nvfp4,bf16")] == ["nvfp4+aqn", "nvfp4", "bf16"]
    with pytest.raises(StudyError, match="twice"):
        study.parse_arms("nvfp4+aqn,nvfp4+aqn:exponential")
    with pytest.raises(StudyError, match="no arm"):
        study.parse_arms(" , ")
    assert [a.name for a in study.parse_arms("nvfp4@1e-4,nvfp4@5e-4")] == ["nvfp4@0.0001", "nvfp4@0.0005"]
    with pytest.raises(StudyError, match="twice"):
        study.parse_arms("nvfp4@1e-4,nvfp4@0.0001")
    assert study.parse_seeds("0,1,2") == [0, 1, 2]
    for bad in ("", "a", "0,0", "-1"):
        with pytest.raises(StudyError):
            study.parse_seeds(bad)


def test_qerl_bench_study_is_the_study_command(capsys):
    from qerl.cli import build_parser

    args = build_parser().parse_args(["bench", "study", "--arms", "nvfp4+noise", "--seeds", "0"])
    assert args.what == "study" and args.func(args) == 2  # refused before any job starts
    assert "error: arm 'nvfp4+noise'" in capsys.readouterr().err
    assert study.build_parser(prog="qerl bench study").format_usage().startswith("usage: qerl bench study ")


def test_set_may_not_override_what_the_study_sets():
    study.check_overrides(["optim.lr=1e-4", "aqn.num_stages=5"])
    with pytest.raises(StudyError, match="aqn.decay"):
        study.check_overrides(["aqn.decay=linear"])


def test_a_set_scoped_to_a_format_reaches_only_its_arms(tmp_path):
    study.check_overrides(["nf4:model.dense_weights=all", "optim.lr=1e-4"])
    with pytest.raises(StudyError, match="not a weight format"):
        study.check_overrides(["nf5:model.dense_weights=all"])
    with pytest.raises(StudyError, match="aqn.decay"):
        study.check_overrides(["nvfp4:aqn.decay=linear"])
    items = ["nf4:model.dense_weights=all", "optim.lr=1e-4", "nvfp4:model.keep_bf16=[last:2]"]
    nf4, nvfp4, bf16 = study.parse_arms("nf4+aqn,nvfp4,bf16")
    assert study.arm_sets(items, nf4) == ["model.dense_weights=all", "optim.lr=1e-4"]
    assert study.arm_sets(items, nvfp4) == ["optim.lr=1e-4", "model.keep_bf16=[last:2]"]
    assert study.arm_sets(items, bf16) == ["optim.lr=1e-4"]


def test_jobs_are_seed_major(tmp_path):
    jobs = study.make_jobs(study.parse_arms("nvfp4,bf16+aqn"), [0, 1], tmp_path)
    assert [j.name for j in jobs] == ["nvfp4_s0", "bf16_aqn_s0", "nvfp4_s1", "bf16_aqn_s1"]
    assert jobs[1].result_path == tmp_path / "bf16_aqn_s0" / "result.json"


# aggregation ---------------------------------------------------------------------------------------


def _run(arm, seed, **values):
    base = {key: 0.0 for key, _, _ in study_report.AGGREGATED}
    base.update(values)
    steps = [{"step": s + 1, "reward": 0.1 * s + seed, "entropy": 0.5} for s in range(5)]
    return {"arm": arm, "seed": seed, **base, "metrics": steps}


def test_aggregate_mean_and_sample_std():
    runs = [_run("nvfp4", 0, pass1_after=0.2), _run("nvfp4", 1, pass1_after=0.4), _run("nvfp4", 2, pass1_after=0.6),
            _run("bf16", 0, pass1_after=0.8, memory_gb=None)]
    agg = study_report.aggregate(runs, ["bf16", "nvfp4", "nf4"])
    assert list(agg) == ["bf16", "nvfp4"]  # arm order kept, arms without runs left out
    stat = agg["nvfp4"]["pass1_after"]
    assert stat["n"] == 3 and stat["mean"] == pytest.approx(0.4) and stat["std"] == pytest.approx(0.2)
    assert agg["nvfp4"]["seeds"] == [0, 1, 2]
    assert agg["bf16"]["pass1_after"] == {"mean": 0.8, "std": None, "n": 1}  # n = 1: no spread
    assert agg["bf16"]["memory_gb"] == {"mean": None, "std": None, "n": 0}
    table = study_report.markdown_table(agg)
    assert "| nvfp4 | 3 |" in table and "0.400 ± 0.200" in table
    assert "0.800 ± -" in table
    assert table.splitlines()[1].count("---") == len(study_report.AGGREGATED) + 2
    assert json.loads(json.dumps(agg)) == agg  # plain JSON: no NaN


def test_mean_std_ignores_missing_values():
    want = {"mean": 2.0, "std": pytest.approx(math.sqrt(2)), "n": 2}
    assert study_report.mean_std([1.0, None, float("nan"), 3.0]) == want


def test_summarize_first_and_last_fifth():
    metrics = [{"step": i + 1, "reward": float(i), "entropy": 1.0, "time_rollout": 1.0, "time_update": 2.0,
                "memory_gb": float(i)} for i in range(10)]
    s = study.summarize(metrics)
    assert (s["reward_first"], s["reward_last"]) == (0.5, 8.5)
    assert (s["time_update"], s["memory_gb"]) == (2.0, 9.0)


def test_plots_include_the_ablation_only_with_two_decays(tmp_path):
    runs = [_run(a, s) for a in ("nvfp4", "nvfp4+aqn", "nvfp4+aqn:linear", "bf16") for s in (0, 1)]
    agg = study_report.aggregate(runs)
    assert study_report.ablation_arms(list(agg)) == ["nvfp4", "nvfp4+aqn", "nvfp4+aqn:linear"]
    names = {p.name for p in study_report.plot_study(runs, agg, tmp_path)}
    assert names == {"study_reward.png", "study_entropy.png", "study_pass1.png", "study_ablation_reward.png"}
    assert study_report.ablation_arms(["nvfp4", "nvfp4+aqn", "bf16+aqn:linear"]) == []


# finished jobs, failures, the deadline --------------------------------------------------------------

SETTINGS = {"model": "m", "steps": 3}


def _write_result(job: Job, settings=SETTINGS):
    job.dir.mkdir(parents=True, exist_ok=True)
    study_jobs.write_json_atomic(job.result_path, {"arm": job.arm.name, "seed": job.seed, "settings": settings})


def test_finished_jobs_are_skipped(tmp_path):
    jobs = study.make_jobs(study.parse_arms("nvfp4,bf16"), [0], tmp_path)
    _write_result(jobs[1])
    todo, done = study.split_finished(jobs, SETTINGS)
    assert (todo, done) == ([jobs[0]], [jobs[1]])
    with pytest.raises(StudyError, match="other settings"):
        study.split_finished(jobs, {**SETTINGS, "steps": 4})


def test_a_finished_job_made_from_an_edited_config_file_is_refused(tmp_path):
    from qerl.config import load_config

    jobs = study.make_jobs(study.parse_arms("nvfp4+aqn"), [0], tmp_path)
    then = study.comparable_config(load_config(None, ["aqn.sigma_start=0.01"]))
    now = study.comparable_config(load_config(None, ["aqn.sigma_start=0.1", "seed=5", "output_dir=x"]))
    jobs[0].dir.mkdir(parents=True)
    study_jobs.write_json_atomic(jobs[0].result_path, {"arm": "nvfp4+aqn", "seed": 0, "settings": SETTINGS,
                                                       "config": then})
    assert study.split_finished(jobs, SETTINGS, {jobs[0]: then}) == ([], jobs)  # seed, output_dir not compared
    with pytest.raises(StudyError, match="config aqn.sigma_start differs"):
        study.split_finished(jobs, SETTINGS, {jobs[0]: now})
    assert study.config_diffs({"a": {"b": 1, "c": [1]}}, {"a": {"b": 1, "c": [2]}, "d": 0}) == ["a.c", "d"]
    off = {"aqn": {"enabled": False, "sigma_start": 0.1}, "optim": {"lr": 5e-5}}
    changed_sigma = {"aqn": {"enabled": False, "sigma_start": 0.05}, "optim": {"lr": 5e-5}}
    assert study.config_diffs(off, changed_sigma) == []  # noise settings of a run without AQN are inert
    assert study.config_diffs(off, {**changed_sigma, "optim": {"lr": 1e-4}}) == ["optim.lr"]
    assert study.config_diffs({"aqn": {**off["aqn"], "enabled": True}},
                              {"aqn": {**changed_sigma["aqn"], "enabled": True}}) == ["aqn.sigma_start"]


# children: write result.json (argv[1]) and exit; or fail; or sleep past the deadline
_WRITE = "import json, sys; json.dump({'ok': 1}, open(sys.argv[1], 'w'))"
_FAIL = "import sys; print('working'); raise ValueError('boom')"
_SLEEP = "import time; time.sleep(60)"


def _fake(codes: dict):
    return lambda job: [sys.executable, "-c", codes[job.arm.name], str(job.result_path)]


def test_run_jobs_reports_failures_and_clears_stale_dirs(tmp_path):
    jobs = study.make_jobs(study.parse_arms("nvfp4,bf16,nf4"), [0], tmp_path)
    jobs[0].dir.mkdir(parents=True)
    (jobs[0].dir / "metrics.jsonl").write_text("{}\n")  # a run killed earlier, no result.json
    codes = {"nvfp4": _WRITE, "bf16": _FAIL, "nf4": "pass"}
    outcomes = study_jobs.run_jobs(jobs, _fake(codes), parallel=2, poll_s=0.05, log=lambda *a: None)
    assert [o["status"] for o in outcomes] == ["done", "failed", "failed"]
    assert not (jobs[0].dir / "metrics.jsonl").exists()
    assert outcomes[1]["error"] == "ValueError: boom" and "working" in outcomes[1]["log_tail"]
    assert "without writing result.json" in outcomes[2]["error"]


def test_deadline_kills_running_and_skips_waiting_jobs(tmp_path):
    jobs = study.make_jobs(study.parse_arms("nvfp4,bf16,nf4"), [0], tmp_path)
    codes = {"nvfp4": _WRITE, "bf16": _SLEEP, "nf4": _WRITE}
    t0 = time.monotonic()
    outcomes = study_jobs.run_jobs(jobs, _fake(codes), parallel=2, deadline=t0 + 3.0, poll_s=0.05, log=lambda *a: None)
    assert time.monotonic() - t0 < 10
    # nvfp4 finishes and frees its slot; nf4 is started only if the deadline is not in reach
    assert outcomes[0]["status"] == "done"
    assert outcomes[1]["status"] == "killed" and "deadline" in outcomes[1]["error"]
    assert outcomes[2]["status"] in ("done", "not run")

    late = study_jobs.run_jobs(jobs, _fake(codes), parallel=1, deadline=time.monotonic() - 1, log=lambda *a: None)
    assert [o["status"] for o in late] == ["not run"] * 3


_DEVICE = "import json, os, sys; json.dump({'gpu': os.environ['CUDA_VISIBLE_DEVICES']}, open(sys.argv[1], 'w'))"


def test_run_jobs_spreads_jobs_over_devices_and_resume_keeps_stale_dirs(tmp_path):
    jobs = study.make_jobs(study.parse_arms("nvfp4,bf16,nf4"), [0], tmp_path)
    jobs[0].dir.mkdir(parents=True)
    (jobs[0].dir / "metrics.jsonl").write_text("{}\n")  # what a killed attempt left: kept for the trainer's resume
    jobs[0].log_path.write_text("first attempt\n")
    codes = {"nvfp4": _DEVICE, "bf16": _DEVICE, "nf4": _DEVICE}
    outcomes = study_jobs.run_jobs(jobs, _fake(codes), parallel=2, poll_s=0.05, log=lambda *a: None, resume=True,
                                   devices=["3", "5"])
    assert [o["status"] for o in outcomes] == ["done"] * 3
    assert (jobs[0].dir / "metrics.jsonl").exists() and jobs[0].log_path.read_text() == "first attempt\n"
    gpus = [json.loads(j.result_path.read_text())["gpu"] for j in jobs]
    assert set(gpus[:2]) == {"3", "5"} and gpus[2] in ("3", "5")  # the first two run at once, one per device


def test_job_devices(monkeypatch):
    assert study.job_devices("none") is None
    assert study.job_devices("1, 0") == ["1", "0"]
    with pytest.raises(StudyError, match="--gpus"):
        study.job_devices("0,0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert study.job_devices("auto") == ["4", "6"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert study.job_devices("auto") is None  # one GPU: nothing to spread


def test_jobs_sharing_a_gpu_each_get_an_equal_capped_share(tmp_path):
    """--gpu-memory-fraction auto caps each job only where several share one GPU; the cap reaches the child's
    command line, which sets torch's per-process memory fraction before it builds anything."""
    assert study.memory_fraction("auto", 1, None) is None  # one job at a time: the whole card
    assert study.memory_fraction("auto", 3, None) == pytest.approx(study.SHARED_GPU_FRACTION / 3, abs=1e-4)
    assert study.memory_fraction("auto", 4, ["0", "1"]) == pytest.approx(study.SHARED_GPU_FRACTION / 2, abs=1e-4)
    assert study.memory_fraction("auto", 2, ["0", "1"]) is None  # one job per GPU
    assert study.memory_fraction("none", 8, None) is None and study.memory_fraction("0.25", 1, None) == 0.25
    for bad in ("0", "1.5", "half", "-0.1"):
        with pytest.raises(StudyError, match="--gpu-memory-fraction"):
            study.memory_fraction(bad, 2, None)
    args = study.build_parser().parse_args(["--arms", "nvfp4", "--seeds", "0"])
    job = study.make_jobs(study.parse_arms("nvfp4"), [0], tmp_path)[0]
    capped = study.job_command(args, job, 0.3)
    assert capped[capped.index("--gpu-memory-fraction") + 1] == "0.3"  # the child caps itself (run_job)
    assert "--gpu-memory-fraction" not in study.job_command(args, job)
    child = study.build_parser().parse_args(capped[capped.index("--job"):])
    assert study.memory_fraction(child.gpu_memory_fraction, 1, None) == 0.3  # what run_job is given
    assert study.main(["--arms", "nvfp4", "--gpu-memory-fraction", "2"]) == 2


def test_main_refuses_bad_arguments(capsys):
    assert study.main(["--arms", "nvfp4:linear"]) == 2
    assert "only makes sense with AQN" in capsys.readouterr().err
    assert study.main(["--arms", "nvfp4", "--set", "seed=3"]) == 2
    assert study.main(["--arms", "nvfp4", "--set", "optim.nonsense=1"]) == 2
    assert "optim.nonsense" in capsys.readouterr().err
    assert study.main(["--arms", "nvfp4", "--test", "missing/test.jsonl"]) == 2
    assert "--test missing/test.jsonl: no such file" in capsys.readouterr().err
    assert study.main(["--arms", "nvfp4@1e-4", "--set", "optim.lr=1e-3"]) == 2
    assert "both set the learning rate" in capsys.readouterr().err
    assert study.main(["--arms", "nvfp4", "--eval-limit", "-1"]) == 2
    assert "--eval-limit must be >= 0" in capsys.readouterr().err


def test_mps_is_optional(monkeypatch):
    monkeypatch.setattr(study_jobs.shutil, "which", lambda name: None)
    lines = []
    with study_jobs.MPSDaemon(True, log=lines.append) as mps:
        assert not mps.started
    assert "not found" in lines[0]


# end to end ------------------------------------------------------------------------------------------


TINY_SETTINGS = {"data.max_prompt_tokens": 32, "data.suffix": "none", "rollout.prompts_per_step": 2,
                 "rollout.group_size": 4, "rollout.max_new_tokens": 8, "lora.r": 4, "lora.alpha": 8,
                 "aqn.num_stages": 2, "optim.micro_batch_size": 8, "optim.gradient_checkpointing": "false",
                 "plots": "false", "save_every": 1}


def tiny_study_inputs(tmp_path) -> tuple[str, str]:
    """A tiny random qwen2 with its tokenizer, and 25 two-term sums as a jsonl source: (model dir, data file)."""
    model_dir = tmp_path / "model"
    tiny_model("qwen2", dtype=torch.bfloat16).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    rows = [{"question": f"{a}+{b}=?", "answer": str(a + b)} for a in range(1, 6) for b in range(1, 6)]
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(model_dir), str(data)


def test_study_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """Two arms x one seed as two concurrent subprocesses on the CPU, then a second call that only aggregates."""
    model_dir, data = tiny_study_inputs(tmp_path)
    out = tmp_path / "study"
    settings = {**TINY_SETTINGS, "optim.lr": 1e-3}
    argv = ["--model", model_dir, "--train", data, "--test", data, "--eval-limit", "4", "--eval-n", "1",
            "--arms", "nvfp4+aqn,bf16", "--seeds", "0", "--steps", "2", "--parallel", "2", "--out", str(out),
            "--deadline-s", "240", *[x for k, v in settings.items() for x in ("--set", f"{k}={v}")]]
    code = study.main(argv)
    printed = capsys.readouterr().out
    logs = {p.name: p.read_text()[-3000:] for p in out.glob("*/job.log")}
    assert code == 0, (printed, logs)
    for name in ("nvfp4_aqn_s0", "bf16_s0"):
        result = json.loads((out / name / "result.json").read_text())
        assert [m["step"] for m in result["metrics"]] == [1, 2]
        assert 0 <= result["pass1_after"] <= 1 and result["seconds"] > 0
        for when in ("before", "after"):  # the strict score and the two shares next to the flexible one
            assert all(0 <= result[k] <= 1 for k in (f"pass1_{when}_strict", f"no_answer_{when}", f"format_{when}"))
        assert (out / name / "metrics.jsonl").is_file()
    summary = json.loads((out / "results.json").read_text())
    assert summary["parallel"] == 2 and len(summary["runs"]) == 2
    assert [j["status"] for j in summary["jobs"]] == ["done", "done"]
    assert summary["aggregate"]["bf16"]["pass1_after"]["n"] == 1
    assert all((out / f"study_{k}.png").is_file() for k in ("reward", "entropy", "pass1"))
    assert "| nvfp4+aqn | 1 |" in printed and "inflated" in printed and "strict pass@1 after" in printed
    claims_md = (out / "claims.md").read_text()  # arms nvfp4+aqn and bf16, one seed each
    assert "Table 1" in claims_md and "after RL >= 16-bit LoRA" in claims_md and claims_md.strip() in printed

    t0 = time.monotonic()
    assert study.main(argv) == 0  # everything finished: nothing runs again
    assert time.monotonic() - t0 < 30
    printed = capsys.readouterr().out
    assert printed.count("[cached]") == 2 and "[start]" not in printed

    # a job killed after its step-1 checkpoint: the next call continues it from there, keeping its "before"
    job = out / "bf16_s0"
    finished = json.loads((job / "result.json").read_text())
    (job / "result.json").unlink()
    for checkpoint in (job / "checkpoints").glob("step-*"):
        if not checkpoint.name.endswith("1"):
            shutil.rmtree(checkpoint)
    state = json.loads((job / "job_state.json").read_text())
    # (a job_state.json written before the strict scores existed: only the flexible "before")
    later = ("pass1_before_strict", "no_answer_before", "format_before")
    old_state = {k: v for k, v in state.items() if k not in later}
    study_jobs.write_json_atomic(job / "job_state.json", {**old_state, "pass1_before": 0.125})
    assert study.main(argv) == 0
    resumed = json.loads((job / "result.json").read_text())
    assert resumed["attempts"] == 2 and resumed["pass1_before"] == 0.125
    assert "pass1_before_strict" not in resumed and 0 <= resumed["pass1_after_strict"] <= 1
    assert [m["step"] for m in resumed["metrics"]] == [1, 2]
    assert resumed["metrics"][0] == finished["metrics"][0]  # step 1 kept, not redone
    assert "resumed from" in (job / "job.log").read_text()

    # an unfinished job made with other settings is refused, not mixed in
    (job / "result.json").unlink()
    study_jobs.write_json_atomic(job / "job_state.json", {**state, "settings": {**state["settings"], "steps": 9}})
    assert study.main(argv) == 1
    assert "other settings" in (job / "job.log").read_text()


def test_a_learning_rate_sweep_leaves_the_held_out_set_alone(tmp_path, capsys):
    """--eval-limit 0 with two @LR arms: no held-out score before or after, no pass@1 plot, the rate picked
    by late training reward and written to lr_sweep.md."""
    model_dir, data = tiny_study_inputs(tmp_path)
    out = tmp_path / "sweep"
    argv = ["--model", model_dir, "--train", data, "--eval-limit", "0", "--arms", "bf16@1e-3,bf16@1e-2",
            "--seeds", "0", "--steps", "2", "--parallel", "2", "--out", str(out), "--deadline-s", "240",
            *[x for k, v in TINY_SETTINGS.items() for x in ("--set", f"{k}={v}")]]
    code = study.main(argv)
    printed = capsys.readouterr().out
    logs = {p.name: p.read_text()[-3000:] for p in out.glob("*/job.log")}
    assert code == 0, (printed, logs)
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["arm"], r["pass1_before"], r["pass1_after"]) for r in runs] == [("bf16@0.001", None, None),
                                                                               ("bf16@0.01", None, None)]
    assert "overlap check" not in printed and not (out / "study_pass1.png").exists()
    best = max(runs, key=lambda r: (r["reward_last"], -float(r["arm"].split("@")[1])))["arm"]
    sweep = (out / "lr_sweep.md").read_text()
    assert f"picked (highest late training reward): {best}" in sweep and "| bf16 |" in sweep
    assert f"picked: {best}" in printed


def test_eval_16bit_base_scores_4bit_adapters_on_the_unquantized_model(tmp_path, capsys):
    """--eval-16bit-base: the NVFP4 + AQN arm's trained adapter is scored again on the 16-bit model after RL
    (pass1_after_16bit, its own table column and Table 1 claim); the bf16 arm's base is that model already."""
    model_dir, data = tiny_study_inputs(tmp_path)
    out = tmp_path / "study16"
    argv = ["--model", model_dir, "--train", data, "--test", data, "--eval-limit", "4", "--eval-n", "1",
            "--eval-temperature", "0", "--eval-16bit-base", "--arms", "nvfp4+aqn,bf16", "--seeds", "0", "--steps", "1",
            "--parallel", "2", "--out", str(out), "--deadline-s", "240",
            *[x for k, v in TINY_SETTINGS.items() for x in ("--set", f"{k}={v}")]]
    code = study.main(argv)
    printed = capsys.readouterr().out
    logs = {p.name: p.read_text()[-3000:] for p in out.glob("*/job.log")}
    assert code == 0, (printed, logs)
    runs = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    for score in ("pass1_after_16bit", "pass1_after_16bit_strict", "no_answer_after_16bit", "format_after_16bit"):
        assert 0 <= runs["nvfp4+aqn"][score] <= 1, score
        assert runs["bf16"][score] == runs["bf16"][score.replace("_after_16bit", "_after")], score
    assert runs["nvfp4+aqn"]["pass1_after_16bit_strict"] <= runs["nvfp4+aqn"]["pass1_after_16bit"]
    assert "pass@1 after, 16-bit base" in printed
    assert "adapter on the 16-bit base after RL >= 16-bit LoRA" in (out / "claims.md").read_text()
    assert "--eval-16bit-base" in study.job_command(study.build_parser().parse_args(argv), study.make_jobs(
        study.parse_arms("nvfp4"), [0], out)[0])


def test_the_16bit_base_column_shows_only_when_measured():
    unmeasured = {"pass1_after_16bit": None, "pass1_after_16bit_strict": None}
    runs = [_run("nvfp4", 0, **unmeasured), _run("bf16", 0, **unmeasured)]
    table = study_report.markdown_table(study_report.aggregate(runs))
    assert "16-bit base" not in table
    # arm, n, and every aggregated column but the two left out
    assert table.splitlines()[1].count("---") == 2 + len(study_report.AGGREGATED) - len(unmeasured)


def test_the_strict_columns_show_only_when_some_run_has_them():
    """results.json files from before the strict scores lack their keys: no empty columns for them."""
    old = [{k: v for k, v in _run(arm, 0).items() if not k.endswith("_strict")} for arm in ("nvfp4", "bf16")]
    table = study_report.markdown_table(study_report.aggregate(old))
    assert "strict" not in table and "| nvfp4 | 1 |" in table
    new = study_report.markdown_table(study_report.aggregate([*old, _run("nf4", 0, pass1_after_strict=0.25)]))
    assert "strict pass@1 before | strict pass@1 after" in new and "| nvfp4 | 1 | " in new
    assert new.splitlines()[-1].count("0.250") == 1


# merging studies ----------------------------------------------------------------------------------


def _merge_study(settings, runs):
    return {"settings": settings, "runs": runs}


def _merge_run(arm, seed, after, first=0.3, last=0.6):
    return {"arm": arm, "seed": seed, "pass1_before": 0.3, "pass1_after": after, "reward_first": first,
            "reward_last": last, "metrics": [{"step": 1, "reward": first, "entropy": 0.2}]}


def test_merged_studies_must_share_settings_and_not_repeat_a_job(tmp_path, capsys):
    from bench_scripts import load_experiment

    merge = load_experiment("study_merge")
    config = Path(__file__).resolve().parents[1] / "configs" / "gsm8k-grpo-1.5b.yaml"
    settings = {"config": str(config), "steps": 100, "set": ["save_every=10"]}
    a = _merge_study(settings, [_merge_run("bf16", s, 0.70 + 0.01 * s) for s in range(3)])
    b = _merge_study(settings, [_merge_run("bf16@0.0001", s, 0.68, last=0.5) for s in range(3)]
                     + [_merge_run("nvfp4", s, 0.66) for s in range(3)])
    assert len(merge.merge([a, b])) == 9
    with pytest.raises(SystemExit, match="differs from study 1 in steps"):
        merge.merge([a, _merge_study({**settings, "steps": 30}, b["runs"])])
    with pytest.raises(SystemExit, match="bf16 seed 0 is in two studies"):
        merge.merge([a, a])
    # one arm, two resolved configs (the config file was edited between the studies): refused
    edited = _merge_study(settings, [{**_merge_run("nvfp4+aqn", 0, 0.6), "config": {"aqn": {"sigma_start": 0.01}}},
                                     {**_merge_run("nvfp4+aqn", 1, 0.6), "config": {"aqn": {"sigma_start": 0.1}}}])
    with pytest.raises(SystemExit, match="other configs .aqn.sigma_start"):
        merge.merge([edited])
    # arms without @LR ran at the config's rate, so they join their format's sweep under it
    assert [r["arm"] for r in merge.with_base_lr(merge.merge([a, b]), 5e-5)][::3] == \
        ["bf16@5e-05", "bf16@0.0001", "nvfp4@5e-05"]
    recorded = {**_merge_run("nf4", 0, 0.6), "config": {"optim": {"lr": 2e-5}}}
    assert merge.with_base_lr([recorded], 5e-5)[0]["arm"] == "nf4@2e-05"  # the rate the run recorded wins
    for i, study_ in enumerate((a, b)):
        (tmp_path / f"s{i}.json").write_text(json.dumps(study_))
    assert merge.main([str(tmp_path / "out"), str(tmp_path / "s0.json"), str(tmp_path / "s1.json"),
                       "--arms", "bf16,nvfp4", "--compare", "nvfp4/bf16"]) == 0
    text = (tmp_path / "out" / "merged.md").read_text()
    assert "pass@1 after: nvfp4 0.660 vs bf16 0.710, difference -0.050" in text  # 0.66 against 0.70/0.71/0.72
    assert "16-bit base" not in text  # neither study ran --eval-16bit-base
    served = [_merge_study(settings, [{**r, "pass1_after_16bit": r["pass1_after"] + 0.05} for r in st["runs"]])
              for st in (a, b)]
    for i, study_ in enumerate(served):
        (tmp_path / f"served{i}.json").write_text(json.dumps(study_))
    assert merge.main([str(tmp_path / "out16"), str(tmp_path / "served0.json"), str(tmp_path / "served1.json"),
                       "--arms", "bf16,nvfp4", "--compare", "nvfp4/bf16"]) == 0
    assert "pass@1 after, 16-bit base: nvfp4 0.710 vs bf16 0.760, difference -0.050" in \
        (tmp_path / "out16" / "merged.md").read_text()
    with pytest.raises(SystemExit, match="expected pairs A/B"):
        merge.main([str(tmp_path / "o2"), str(tmp_path / "s0.json"), "--compare", "nvfp4"])
    assert "| bf16 | 3 |" in text and "| nvfp4 | 3 |" in text and "bf16@0.0001 | 3" not in text  # table: --arms
    assert "| bf16 | **5e-05** |" in text  # the rate table still sees every run; 5e-5 won
    assert (tmp_path / "out" / "study_reward.png").is_file()
    assert "| bf16 | 3 | 0.300 | - | - | - | - | 0 of 3 | - |" in text  # steps 1-3 reward; no other metric recorded
    # a step whose noisy rollouts blew up is named with its numbers
    blown = [{**_merge_run("nvfp4+aqn", 0, 0.6), "metrics": [
        {"step": 1, "reward": 0.2, "entropy": 0.3, "grad_norm": 0.1, "truncated_fraction": 0.0},
        {"step": 2, "reward": 0.05, "entropy": 6.0, "grad_norm": 0.3, "truncated_fraction": 0.8}]},
        _merge_run("nvfp4+aqn", 1, 0.6)]
    row = merge.step_diagnostics_markdown(blown, ["nvfp4+aqn"]).splitlines()[-1]
    assert row == "| nvfp4+aqn | 2 | 0.212 | 0.200 | - | - | 0.400 | 1 of 2 | seed 0 step 2: 6.00, 0.80, 0.05 |"


def test_study_window_reads_finished_and_unfinished_studies(tmp_path, capsys):
    """experiments/study_window.py: the same window from a results.json and from a study directory whose jobs
    stopped early (job_state.json + metrics.jsonl, no result.json); a run short of the window is named, not
    averaged in."""
    from bench_scripts import load_experiment

    window = load_experiment("study_window")
    steps = lambda n, r: [{"step": s, "reward": r + 0.01 * s, "entropy": 0.2} for s in range(1, n + 1)]  # noqa: E731
    done = tmp_path / "results.json"
    done.write_text(json.dumps({"runs": [{"arm": "bf16", "seed": 0, "metrics": steps(10, 0.5)}]}))
    partial = tmp_path / "partial"
    for seed, n in ((6, 8), (7, 3)):
        job = partial / f"nvfp4_s{seed}"
        job.mkdir(parents=True)
        (job / "job_state.json").write_text(json.dumps({"settings": {"arm": "nvfp4", "seed": seed}}))
        (job / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in steps(n, 0.4)) + "\n")
    assert window.main(["--steps", "4-6", str(done), str(partial)]) == 0
    out = capsys.readouterr().out
    assert "| bf16 | 0 | 0.550 | 0.550 | 0.200 | - |" in out  # mean of 0.54, 0.55, 0.56
    assert "| nvfp4 | 6 | 0.450 | 0.450 | 0.200 | 7 |" in out  # seed 7 stopped at step 3
    with pytest.raises(SystemExit):
        window.main(["--steps", "6-4", str(done)])
    with pytest.raises(SystemExit, match="neither a results.json"):
        window.main(["--steps", "1-2", str(tmp_path / "empty_dir_that_is_missing")])


def test_eval_16bit_base_refuses_a_quantized_checkpoint(tmp_path, capsys):
    quantized = tmp_path / "q"
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({"model_type": "qwen2", "quantization_config": {}}))
    code = study.main(["--model", str(quantized), "--eval-16bit-base", "--out", str(tmp_path / "o")])
    assert code != 0 and "is a quantized checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before any job
