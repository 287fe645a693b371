"""benchmarks/peers/side_by_side.py end to end on a tiny random model (CPU): a qerl job trains, its adapter is scored
on both bases, the table reads them back, and a second run re-runs nothing; the commands of the peers' jobs."""

import json
import subprocess
import sys

import pytest
from bench_scripts import ROOT, load_peer



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
    first = side_by_side("--out", str(out), "--jobs", "qerl-nvfp4", *job)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    row = json.loads((out / "side_by_side.json").read_text())["rows"][0]
    assert row["job"] == "qerl-nvfp4" and row["seeds"] == 1
    assert row["median_step_s"] > 0 and row["first_step_s"] > 0
    for base in ("16bit", "own"):  # the 4-bit job's adapter on the 16-bit model and on its NVFP4 base
        lines = (out / "qerl-nvfp4_s0" / f"eval_{base}" / "eval.jsonl").read_text().splitlines()
        assert len(lines) == 2
        rewards = [r for line in lines for r in json.loads(line)["rewards"]]
        assert row[f"pass1_{base}"] == pytest.approx(sum(rewards) / len(rewards))
    again = side_by_side("--out", str(out), "--jobs", "qerl-nvfp4", *job)
    assert again.returncode == 0 and "[start]" not in again.stdout + again.stderr
    assert json.loads((out / "side_by_side.json").read_text())["rows"][0] == row


def test_peer_commands_carry_the_seed_and_unknown_jobs_are_refused(tmp_path):
    dry = side_by_side("--out", str(tmp_path), "--jobs", "trl-fast,unsloth-4bit", "--seeds", "3", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-2000:]
    lines = dry.stdout.strip().splitlines()
    assert any("trl_grpo.py" in line and "--liger" in line and "seed=3" in line for line in lines)
    assert any("unsloth_grpo.py" in line and "--weights 4bit" in line for line in lines)
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
