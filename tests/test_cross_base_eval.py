"""experiments/cross_base_eval.py on hand-made eval files: the per-arm table, the base and adapter differences
with their standard errors, mismatched problem sets refused, and the compact copy reading back the same."""

import json
import math
import statistics

import pytest
from bench_scripts import load_experiment


def write_eval(path, rewards, questions=None):
    questions = questions or [f"q{i}" for i in range(len(rewards))]
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 1", "completions": ["x"] * len(r),
                                        "rewards": r, "lengths": [3] * len(r)}) + "\n"
                            for q, r in zip(questions, rewards)))


@pytest.fixture
def evals(tmp_path):
    # seed s, arm, base -> 4 problems' rewards (two samples each)
    table = {
        ("bf16", 0, "bf16"): [[1, 1], [1, 0], [0, 0], [1, 1]],    # 0.625
        ("bf16", 0, "nvfp4"): [[1, 0], [1, 0], [0, 0], [1, 1]],   # 0.5
        ("bf16", 1, "bf16"): [[1, 1], [1, 1], [0, 0], [1, 1]],    # 0.75
        ("bf16", 1, "nvfp4"): [[1, 1], [0, 0], [0, 0], [1, 1]],   # 0.5
        ("nvfp4_aqn-s0.05_linear", 0, "bf16"): [[1, 1], [1, 1], [0, 1], [1, 1]],  # 0.875
        ("nvfp4_aqn-s0.05_linear", 1, "bf16"): [[1, 1], [1, 0], [0, 0], [1, 1]],  # 0.625
    }
    for (arm, seed, base), rewards in table.items():
        write_eval(tmp_path / f"{arm}_s{seed}_on_{base}.jsonl", rewards)
    write_eval(tmp_path / "bf16_s0_on_bf16_t0.6n4.jsonl", [[0]] * 4)  # another tag: not read without --tag
    return tmp_path, table


def test_table_and_differences(evals, capsys):
    cross = load_experiment("cross_base_eval")
    directory, table = evals
    loaded = cross.load(directory, "")
    assert set(loaded) == set(table)
    assert loaded["bf16", 0, "bf16"] == [1.0, 0.5, 0.0, 1.0]

    base = cross.difference([(loaded["bf16", s, "bf16"], loaded["bf16", s, "nvfp4"]) for s in (0, 1)])
    assert base["diff"] == pytest.approx(0.1875)  # (0.125 + 0.25) / 2
    assert base["se_seed"] == pytest.approx(statistics.stdev([0.125, 0.25]) / math.sqrt(2))
    per_problem = [statistics.stdev([0, 0.5, 0, 0]) / 2, statistics.stdev([0, 1, 0, 0]) / 2]
    assert base["se_problems"] == pytest.approx(math.sqrt(sum(v * v for v in per_problem)) / 2)
    assert base["se"] == max(base["se_seed"], base["se_problems"])

    assert cross.main([str(directory)]) == 0
    out = capsys.readouterr().out
    assert "| bf16 | 0.688 (0.625 / 0.750) | 0.500 (0.500 / 0.500) |" in out
    assert "| nvfp4_aqn-s0.05_linear | 0.750 (0.875 / 0.625) | - |" in out
    assert "| bf16: bf16 base − nvfp4 base | +0.188 ± " in out
    assert "| on bf16: nvfp4_aqn-s0.05_linear − bf16 | +0.062 ± " in out
    assert "on nvfp4: nvfp4_aqn" not in out  # no such evaluation

    assert cross.main([str(directory), "--tag", "_t0.6n4"]) == 0
    assert "| bf16 | 0.000 (0.000) |\n" in capsys.readouterr().out  # one base: one column


def test_refuses_other_problems_and_compacts(evals, tmp_path):
    cross = load_experiment("cross_base_eval")
    directory, table = evals
    compact = tmp_path / "compact"
    assert cross.main([str(directory), "--compact", str(compact)]) == 0
    rows = [json.loads(line) for line in (compact / "bf16_s0_on_bf16.jsonl").read_text().splitlines()]
    assert "completions" not in rows[0] and "question" not in rows[0] and rows[0]["rewards"] == [1, 1]
    assert cross.load(compact, "") == cross.load(directory, "")  # the compact copy reports the same

    write_eval(directory / "bf16_s2_on_bf16.jsonl", [[1]] * 4, questions=["other", "q1", "q2", "q3"])
    with pytest.raises(SystemExit, match="different problems"):
        cross.load(directory, "")
    with pytest.raises(SystemExit):
        cross.main([str(directory), "--reference", "nf4"])
