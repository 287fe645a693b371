"""The fixed offline GSM8K split (held-out first 500 test problems, train on the rest), the contamination
warning between a training and an evaluation source, and the word-overlap check."""

import logging

import numpy as np
import pytest

from qerl.data import DatasetError, load_problems
from qerl.data.datasets import GSM8K_HELDOUT, GSM8K_TRAIN_OFFLINE, HELDOUT_OF, contamination_warning
from qerl.data.offline import GSM8K_HELDOUT_SIZE, gsm8k_heldout, gsm8k_test, gsm8k_train_offline
from qerl.data.overlap import format_summary, max_overlap, words


def test_split_sizes_order_and_disjoint(caplog):
    caplog.set_level(logging.WARNING)
    full = load_problems("gsm8k-offline", split="test")
    held = load_problems(GSM8K_HELDOUT, split="test")
    train = load_problems(GSM8K_TRAIN_OFFLINE, split="train")
    assert GSM8K_HELDOUT_SIZE == 500 and len(held) == 500 and len(train) == 819
    assert held == full[:500] and train == full[500:]  # file order, the boundary the one constant
    assert not {r["question"] for r in held} & {r["question"] for r in train}
    assert load_problems(GSM8K_TRAIN_OFFLINE, split="train") == train  # stable
    assert load_problems(GSM8K_TRAIN_OFFLINE, split="train", limit=3) == train[:3]
    assert [r["question"] for r in gsm8k_heldout()] == [r["question"] for r in held]
    assert gsm8k_heldout() + gsm8k_train_offline() == gsm8k_test()
    assert not caplog.text  # training on the train part and evaluating on the held-out part: no warning


def test_warnings_for_training_on_evaluation_problems(caplog):
    caplog.set_level(logging.WARNING)
    load_problems("gsm8k-offline", split="train", limit=3)
    assert "TEST split" in caplog.text and GSM8K_TRAIN_OFFLINE in caplog.text
    caplog.clear()
    load_problems(GSM8K_HELDOUT, split="train", limit=3)
    assert "held-out evaluation part" in caplog.text


def test_unknown_part_and_the_list_of_sources():
    with pytest.raises(DatasetError, match="gsm8k-offline:heldout .*gsm8k-offline:train"):
        load_problems("gsm8k-offline:test")
    with pytest.raises(DatasetError, match="gsm8k-offline:train, gsm8k-offline:heldout"):
        load_problems("gsm8k-nope")


def test_contamination_warning():
    assert contamination_warning(GSM8K_TRAIN_OFFLINE, GSM8K_HELDOUT) is None
    assert "819 of the 1319" in contamination_warning(GSM8K_TRAIN_OFFLINE, "gsm8k-offline")
    assert "819 of the 1319" in contamination_warning(GSM8K_TRAIN_OFFLINE, "gsm8k")  # hub test split, evaluated
    assert "500 of the 500" in contamination_warning("gsm8k-offline", GSM8K_HELDOUT)
    assert "500 of the 500" in contamination_warning(GSM8K_HELDOUT, GSM8K_HELDOUT)
    assert "gsm_symbolic" in contamination_warning("reasoning-gym:gsm_symbolic?size=50", GSM8K_HELDOUT)
    assert contamination_warning("gsm8k", "gsm8k-offline") is None  # the hub's train split
    assert contamination_warning("reasoning-gym:basic_arithmetic", GSM8K_HELDOUT) is None
    assert contamination_warning(GSM8K_TRAIN_OFFLINE, "reasoning-gym:basic_arithmetic") is None
    assert HELDOUT_OF[GSM8K_TRAIN_OFFLINE] == GSM8K_HELDOUT


def test_words_are_lowercase_alphanumeric_tokens():
    assert words("Janet's ducks lay 16 eggs; she eats 3!") == {"janet", "s", "ducks", "lay", "16", "eggs", "she",
                                                               "eats", "3"}


def test_overlap_duplicate_disjoint_and_partial():
    train = ["the cat sat on the mat", "a dog ran far away", "one two three four"]
    held = ["The cat sat on the MAT.", "zebra yak xylophone", "one two five six", "", "dog ran, cat sat"]
    r = max_overlap(held, train)
    np.testing.assert_allclose(r.scores, [1.0, 0.0, 0.5, 0.0, 0.5])
    assert list(r.best) == [0, -1, 2, -1, 0]  # ties: the first training question
    s = r.summary(top=2)
    assert (s["n"], s["above"], s["max"]) == (5, 1, 1.0) and s["mean"] == pytest.approx(0.4)
    assert s["share_above"] == pytest.approx(0.2)
    assert s["top"] == [{"heldout": 0, "train": 0, "score": 1.0}, {"heldout": 2, "train": 2, "score": 0.5}]
    assert max_overlap(held, train, threshold=0.4).above == 3
    text = format_summary(r, held, train, top=1)
    assert text.startswith("1 of 5 held-out questions (20.0%)") and "the cat sat on the mat" in text


def test_overlap_best_over_blocks(monkeypatch):
    import qerl.data.overlap as overlap

    monkeypatch.setattr(overlap, "BLOCK", 2)  # the best match found in a later block wins
    train = ["a b", "a c", "x y", "a b c d"]
    r = overlap.max_overlap(["a b c d e"], train)
    assert r.scores[0] == pytest.approx(0.8) and r.best[0] == 3
    assert overlap.max_overlap([], train).summary()["n"] == 0
    assert overlap.max_overlap(["a"], []).scores[0] == 0.0


def test_overlap_of_the_split_is_fast_and_exact_duplicates_score_one():
    import time

    held = [r["question"] for r in gsm8k_heldout()]
    train = [r["question"] for r in gsm8k_train_offline()]
    t0 = time.perf_counter()
    r = max_overlap(held, train + held[:7])  # 7 leaked held-out questions
    assert time.perf_counter() - t0 < 10
    assert (r.scores[:7] == 1.0).all() and r.above >= 7


def test_data_overlap_benchmark_prints_the_table(capsys):
    from bench_scripts import load_benchmark

    bench = load_benchmark("data_overlap")
    assert bench.main(["--gym-size", "20", "--symbolic-size", "20"]) == 0
    out = capsys.readouterr().out
    assert "| gsm8k-offline:train | 819 |" in out and "| gsm8k-offline (full test set) | 1319 | 500 (100.0%) |" in out
    assert "| reasoning-gym:gsm_symbolic | 20 |" in out and "| reasoning-gym:products | 20 |" in out
    assert "gsm_symbolic: " in out and "held out (#" in out


def test_study_evaluates_the_train_split_on_the_heldout_split_and_shows_the_overlap(capsys):
    from qerl.study import runner as study

    assert study.default_test(GSM8K_TRAIN_OFFLINE) == GSM8K_HELDOUT
    assert study.default_test("reasoning-gym:chain_sum") == study.DEFAULT_TEST == "reasoning-gym:basic_arithmetic"
    s = study.overlap_check(GSM8K_TRAIN_OFFLINE, GSM8K_HELDOUT, eval_limit=200, seed=0)
    out = capsys.readouterr().out
    assert s["n"] == 200 and s["train"] == GSM8K_TRAIN_OFFLINE and len(s["top"]) == 5
    assert "overlap check (gsm8k-offline:heldout vs gsm8k-offline:train): " in out and "warning" not in out
    s = study.overlap_check(GSM8K_TRAIN_OFFLINE, "gsm8k-offline", eval_limit=1319, seed=0)
    out = capsys.readouterr().out
    assert "warning: training on gsm8k-offline:train and evaluating on gsm8k-offline: 819" in out
    assert s["above"] >= 819 and s["max"] == 1.0
    assert study.overlap_check("gsm8k", GSM8K_HELDOUT, 10, 0) is None
    assert "skipped (hub source)" in capsys.readouterr().out


def test_gsm8k_grpo_1_5b_config_trains_on_the_split():
    from pathlib import Path

    from qerl.config import load_config

    root = Path(__file__).resolve().parents[1] / "configs"
    for path in sorted(root.glob("*.yaml")):  # every recipe still loads
        load_config(path)
    cfg = load_config(root / "gsm8k-grpo-1.5b.yaml")
    assert (cfg.model.name, cfg.model.format) == ("qwen2.5-coder-1.5b-instruct", "nvfp4")
    assert (cfg.lora.r, cfg.lora.alpha) == (32, 64)
    assert cfg.data.train == GSM8K_TRAIN_OFFLINE and cfg.algo.name == "grpo" and cfg.aqn.enabled
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens) == (16, 8, 512)
    assert cfg.optim.lr == 5e-5 and cfg.rollout.temperature == 1.0 and cfg.steps == 100
    assert cfg.output_dir == "runs/gsm8k-grpo-1.5b"
    text = (root / "gsm8k-grpo-1.5b.yaml").read_text()
    assert text.startswith("# GSM8K on one GPU") and f"--dataset {GSM8K_HELDOUT}" in text
