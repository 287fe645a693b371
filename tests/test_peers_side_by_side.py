"""benchmarks/peers/side_by_side.py end to end on a tiny random model (CPU): a qerl job trains, its adapter is scored
on both bases, the table reads them back, and a second run re-runs nothing; the commands of the peers' jobs. The
peers' TRL settings read the prompts in qerl's order and apply qerl's truncated importance sampling, and a TRL run
(transformers generation, where trl is installed) trains on the prompts a qerl run draws, step by step."""

import argparse
import json
import os
import subprocess
import sys

import pytest
from bench_scripts import ROOT, load_peer

from qerl.config import load_config

def tiny_job(tiny_dir, tmp_path):
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=?", "answer": str(a + b)}) + "\n"
                            for a in range(1, 4) for b in range(1, 4)))
    return ["--config", "configs/smollm2-demo.yaml", "--steps", "2", "--eval-limit", "2", "--test", str(data),
            "--set", f"model.name={tiny_dir}", f"data.train={data}", "data.suffix=none", "data.max_prompt_tokens=32",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "lora.r=4",
            "lora.alpha=8", "reward_timeout_s=30"]


def side_by_side(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks/peers/side_by_side.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_qerl_job_trains_is_scored_on_both_bases_and_is_not_run_again(tiny_dir, tmp_path):
    out = tmp_path / "peers"
    job = tiny_job(tiny_dir, tmp_path)
    trained = side_by_side("--out", str(out), "--jobs", "qerl-nvfp4", "--no-eval", *job)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert (out / "qerl-nvfp4_s0" / "run" / "adapter" / "adapter_config.json").is_file()
    assert not list((out / "qerl-nvfp4_s0").glob("eval_*"))  # --no-eval: trained only
    first = side_by_side("--out", str(out), "--jobs", "qerl-nvfp4", "--eval-parallel", "2", *job)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "[start] qerl-nvfp4_s0 " not in first.stdout + first.stderr  # the finished training is kept
    row = json.loads((out / "side_by_side.json").read_text())["rows"][0]
    assert row["job"] == "qerl-nvfp4" and row["seeds"] == 1
    assert row["median_step_s"] > 0 and row["first_step_s"] > 0
    for base in ("16bit", "own"):  # the 4-bit job's adapter on the 16-bit model and on its NVFP4 base
        lines = (out / "qerl-nvfp4_s0" / f"eval_{base}" / "eval.jsonl").read_text().splitlines()
        assert len(lines) == 2
        rewards = [r for line in lines for r in json.loads(line)["rewards"]]
        assert row[f"pass1_{base}"] == pytest.approx(sum(rewards) / len(rewards))
    assert row["importance_sampling"] == {"mode": "token_truncate", "cap": 2.0}
    assert row["prompt_order"] == "qerl's stream"
    assert row["differs"] == list(load_peer("side_by_side").DIFFERS["qerl-nvfp4"])
    assert not (out / "prompts_s0.jsonl").exists()  # the peers' input: not written without a peer job
    again = side_by_side("--out", str(out), "--jobs", "qerl-nvfp4", "--archive", str(tmp_path / "kept"), *job)
    assert again.returncode == 0 and "[start]" not in again.stdout + again.stderr
    assert json.loads((out / "side_by_side.json").read_text())["rows"][0] == row
    # the kept form (no adapter, scores without completions) reads back as the same row
    kept = tmp_path / "kept"
    assert not (kept / "qerl-nvfp4_s0" / "run" / "adapter").exists()
    assert (kept / "qerl-nvfp4_s0" / "eval_own" / "scores.jsonl").is_file()
    back = side_by_side("--out", str(kept), "--jobs", "qerl-nvfp4", "--report", *job)
    assert back.returncode == 0, back.stderr[-2000:]
    assert json.loads((kept / "side_by_side.json").read_text())["rows"][0] == row


def test_peer_commands_carry_the_seed_and_unknown_jobs_are_refused(tmp_path):
    dry = side_by_side("--out", str(tmp_path), "--jobs", "trl-fast,unsloth-4bit", "--seeds", "3", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-2000:]
    lines = dry.stdout.strip().splitlines()
    assert any("trl_grpo.py" in line and "--liger" in line and "seed=3" in line for line in lines)
    assert any("unsloth_grpo.py" in line and "--weights 4bit" in line for line in lines)
    # every peer job is fed its seed's order file, which a dry run does not write
    peers = [line for line in lines if "_grpo.py" in line]
    assert len(peers) == 2 and all(f"--prompts {tmp_path / 'prompts_s3.jsonl'}" in line for line in peers)
    assert not (tmp_path / "prompts_s3.jsonl").exists()
    # both adapters scored on the 16-bit model only (qerl loads neither bitsandbytes nor Unsloth's FP8 base)
    assert sum("qerl.cli eval" in line for line in lines) == 2 and "--format" not in dry.stdout
    bad = side_by_side("--out", str(tmp_path), "--jobs", "trl,vllm", "--dry-run")
    assert bad.returncode == 2 and "unknown job(s) vllm" in bad.stderr


def test_eval_scores_average_each_problem_first(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"rewards": r, "strict": s}) + "\n"
                            for r, s in (([1.0, 0.0], [1.0, 1.0]), ([1.0], [0.0]))))
    assert load_peer("side_by_side").eval_scores(path) == {"pass1": 0.75, "strict": 0.5, "problems": 2}
    assert load_peer("side_by_side").eval_scores(tmp_path / "missing.jsonl") is None


def peer_args(**kw):
    """The arguments `trl_grpo.grpo_settings` reads, as the peer scripts' parsers give them (their defaults)."""
    return argparse.Namespace(**{"steps": 20, "micro_batch": 16, "generation": "vllm", "gpu_memory_utilization": 0.3,
                                 "sleep": False, "liger": False, **kw})


def test_peer_settings_read_prompts_in_order_and_apply_qerls_importance_sampling(tmp_path):
    """TRL's and Unsloth's GRPOConfig arguments for the job: the dataset unshuffled, one generation batch of
    prompts_per_step x group_size per optimizer step, and qerl's TIS (token level, truncated at tis_cap, no lower
    bound) on the sampler's log-probs; Unsloth's too, though its completions come from its own engine."""
    trl, unsloth = load_peer("trl_grpo"), load_peer("unsloth_grpo")  # neither imports trl nor unsloth to build them
    cfg = load_config("configs/gsm8k-grpo-1.5b.yaml", [])
    tis = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
           "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": cfg.algo.tis_cap}
    for settings in (trl.grpo_settings(cfg, peer_args(), tmp_path),
                     trl.grpo_settings(cfg, peer_args(liger=True, sleep=True), tmp_path),
                     unsloth.unsloth_settings(cfg, argparse.Namespace(steps=20, micro_batch=16,
                                                                      gpu_memory_utilization=0.6), tmp_path)):
        assert settings["shuffle_dataset"] is False and settings["use_vllm"] is True
        assert {k: settings[k] for k in tis} == tis and cfg.algo.tis_cap == 2.0
        # TRL's RepeatSampler: generation_batch_size / num_generations consecutive rows a generation batch, one
        # generation batch (steps_per_generation accumulation steps) an optimizer step
        assert settings["per_device_train_batch_size"] * settings["steps_per_generation"] == 16 * 8
        assert settings["gradient_accumulation_steps"] == settings["steps_per_generation"] == 8
        assert settings["num_generations"] == 8 and settings["num_iterations"] == 1 and settings["top_k"] == 0
    assert trl.importance_sampling(settings) == {"mode": "token_truncate", "cap": 2.0}
    # HF generation samples with the loss policy itself: TRL takes no sampler log-probs, nothing to correct
    hf = trl.grpo_settings(cfg, peer_args(generation="transformers"), tmp_path)
    assert hf["vllm_importance_sampling_correction"] is False and trl.importance_sampling(hf) is None
    off = trl.grpo_settings(load_config("configs/gsm8k-grpo-1.5b.yaml", ["algo.tis_cap=null"]), peer_args(), tmp_path)
    assert off["vllm_importance_sampling_correction"] is False
    with pytest.raises(SystemExit, match="old_logprobs"):  # qerl's ratio against the sampler: no TRL twin
        trl.grpo_settings(load_config("configs/gsm8k-grpo-1.5b.yaml", ["algo.old_logprobs=sampling"]), peer_args(),
                          tmp_path)
    assert set(load_peer("side_by_side").DIFFERS) == set(load_peer("side_by_side").JOBS)


def test_an_order_file_holds_whole_steps(tmp_path):
    trl = load_peer("trl_grpo")
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(6)]
    trl.write_prompt_order(tmp_path / "order.jsonl", rows, 2)
    assert [json.loads(line)["step"] for line in (tmp_path / "order.jsonl").read_text().splitlines()] == [1, 1, 2, 2,
                                                                                                          3, 3]
    assert trl.read_prompt_order(tmp_path / "order.jsonl", 2, 2) == rows[:4]
    assert trl.order_digest(rows[:4]) != trl.order_digest(rows[1:5])
    with pytest.raises(SystemExit, match="need 8"):
        trl.read_prompt_order(tmp_path / "order.jsonl", 4, 2)
    with pytest.raises(SystemExit, match="prompts_per_step"):
        trl.read_prompt_order(tmp_path / "order.jsonl", 1, 3)


PROBE = """import json, os


def record(prompts, completions, **columns):
    with open(os.environ["ORDER_PROBE"], "a") as f:
        f.write(json.dumps(list(prompts)) + "\\n")
    return [0.0] * len(completions)
"""


def test_trl_trains_on_the_prompts_qerl_draws_step_by_step(tiny_dir, tmp_path):
    """A qerl run and a TRL run (HF generation, on the CPU) of one job, each scoring with a reward that records the
    prompts it is given: the same prompts in the same steps, past the end of an epoch (9 problems, 6 steps of 2),
    from the order file side_by_side.py writes; the TRL result names that file's digest."""
    pytest.importorskip("trl")
    sbs = load_peer("side_by_side")
    load_peer("trl_grpo")  # the script imports (its trl settings) before it runs as a process below
    (tmp_path / "order_probe.py").write_text(PROBE)
    job = tiny_job(tiny_dir, tmp_path)
    overrides = [*job[job.index("--set") + 1:], "seed=5", "rewards=[order_probe:record]"]
    sbs.write_order_files(tmp_path, [5], argparse.Namespace(config=job[1], set=overrides, steps=6))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    runs = {"qerl": [sys.executable, "-m", "qerl.cli", "train", "--config", job[1], "--output-dir",
                     str(tmp_path / "qerl"), "steps=6", "save_every=0", *overrides],
            "trl": [sys.executable, str(ROOT / "benchmarks/peers/trl_grpo.py"), "--config", job[1], "--steps", "6",
                    "--out", str(tmp_path / "trl"), "--generation", "transformers", "--micro-batch", "2",
                    "--prompts", str(sbs.order_file(tmp_path, 5)), "--set", *overrides]}
    seen = {}
    for name, argv in runs.items():
        probe = tmp_path / f"{name}.jsonl"
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**env, "ORDER_PROBE": str(probe)})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        seen[name] = [json.loads(line)[::2] for line in probe.read_text().splitlines()]  # one per group of 2
    assert len(seen["qerl"]) == 6 and seen["trl"] == seen["qerl"]
    assert len({p for step in seen["qerl"] for p in step}) == 9  # the second epoch began
    result = json.loads((tmp_path / "trl" / "trl.json").read_text())
    assert sbs.order_check(tmp_path, 5, result["prompt_order_sha256"], 12)
    assert not sbs.order_check(tmp_path, 5, result["prompt_order_sha256"], 10)
    assert result["importance_sampling"] is None  # HF generation: the sampler is the loss policy
    assert result["importance_sampling_ratio_mean"] == []
    assert (tmp_path / "trl" / "prompts.jsonl").read_text() == sbs.order_file(tmp_path, 5).read_text()


def test_the_table_checks_each_peers_prompt_order_and_importance_sampling(tmp_path):
    """--report: a peer row says "qerl's" only when every seed's result names the digest of that seed's order file,
    and shows the correction its result file records; every row carries its job's `differs` note."""
    sbs, trl = load_peer("side_by_side"), load_peer("trl_grpo")
    rows = {seed: [{"question": f"q{seed}-{i}", "answer": str(i)} for i in range(40)] for seed in (0, 1)}
    for seed, order in rows.items():
        trl.write_prompt_order(sbs.order_file(tmp_path, seed), order, 16)
    fed = {("trl", 0): rows[0][:32], ("trl", 1): rows[1][:32], ("unsloth-16bit", 0): rows[0][:32],
           ("unsloth-16bit", 1): rows[0][:32]}  # unsloth's seed 1 was fed seed 0's prompts
    for (job, seed), order in fed.items():
        run = tmp_path / f"{job}_s{seed}" / "run"
        run.mkdir(parents=True)
        result = {"median_step_s": 1.0, "time_to_first_step_s": 2.0, "peak_allocated_gb": 3.0, "reward": [0.5, 0.6],
                  "importance_sampling": {"mode": "token_truncate", "cap": 2.0},
                  "importance_sampling_ratio_mean": [0.99, 1.0] if job == "trl" else [],
                  "prompt_order_sha256": trl.order_digest(order)}
        (run / ("trl.json" if job == "trl" else "unsloth.json")).write_text(json.dumps(result))
    done = side_by_side("--out", str(tmp_path), "--jobs", "trl,unsloth-16bit,qerl-bf16", "--seeds", "0,1", "--steps",
                        "2", "--report")
    assert done.returncode == 0, done.stderr[-2000:]
    table = {r["job"]: r for r in json.loads((tmp_path / "side_by_side.json").read_text())["rows"]}
    assert table["trl"]["prompt_order"] == "qerl's" and table["unsloth-16bit"]["prompt_order"] == "differs"
    assert table["trl"]["importance_sampling"] == {"mode": "token_truncate", "cap": 2.0}
    # asked for but never in the trainer's log: the options did not reach the loss
    assert table["unsloth-16bit"]["importance_sampling"] == {"mode": "token_truncate", "cap": 2.0, "logged": False}
    assert table["qerl-bf16"]["seeds"] == 0 and table["qerl-bf16"]["prompt_order"] == "qerl's stream"
    assert all(r["differs"] == list(sbs.DIFFERS[name]) for name, r in table.items())
    assert "| per token, cap 2 | qerl's |" in done.stdout
    assert "| per token, cap 2 (none logged) | differs |" in done.stdout
    assert "- unsloth-16bit: base: bf16" in done.stdout


def test_a_peer_job_stopped_early_keeps_and_shows_what_it_measured(tmp_path):
    """The peers' step timer rewrites progress.json after every logged step; a job with no result file but that
    progress shows as stopped after its steps, with its partial step time and peak, in --report's table."""
    from types import SimpleNamespace

    sbs, trl = load_peer("side_by_side"), load_peer("trl_grpo")
    run = tmp_path / "unsloth-16bit_s0" / "run"
    run.mkdir(parents=True)
    record = {"step_s": []}
    timer = trl.step_timer(record, progress=run / sbs.PROGRESS_FILE)
    history = []
    for step in range(4):
        timer.on_step_begin(None, None, None)
        timer.on_step_end(None, None, None)
        history.append({"reward": 0.25 * step})
        timer.on_log(None, SimpleNamespace(log_history=history), None)
        kept = json.loads((run / sbs.PROGRESS_FILE).read_text())
        assert kept["steps_done"] == step + 1 and kept["reward"] == [0.25 * s for s in range(step + 1)]
    assert kept["median_over"] == "steps 3-4" and kept["step_s"] == record["step_s"]
    done = side_by_side("--out", str(tmp_path), "--jobs", "unsloth-16bit", "--seeds", "0", "--steps", "20",
                        "--report")
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "side_by_side.json").read_text())["rows"][0]
    assert row["seeds"] == 0 and row["partial"][0]["steps_done"] == 4  # shown, never averaged into the row
    assert "stopped after 4 of 20 steps" in done.stdout and "s/step over steps 3-4" in done.stdout
