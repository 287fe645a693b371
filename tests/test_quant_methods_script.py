"""benchmarks/quant_methods.py end to end on a tiny random Qwen2: --keep-completions writes each row's
completions as `qerl eval --out` records that completion_forms.py reads, and the file names carry the row."""

import json
from pathlib import Path

import pytest
from bench_scripts import load_benchmark

methods = load_benchmark("quant_methods")
forms = load_benchmark("completion_forms")


def test_completions_file_names_the_row_not_the_calibration_directory():
    d = Path("/x")
    assert methods.completions_file(d, "bf16") == d / "bf16.jsonl"
    assert methods.completions_file(d, "nvfp4#last:2") == d / "nvfp4_last_2.jsonl"
    assert methods.completions_file(d, "nvfp4-awq@/tmp/a/train.jsonl#last:2|*.down_proj") == \
        d / "nvfp4-awq_train.jsonl_last_2_.down_proj.jsonl"
    assert methods.completions_file(d, "nvfp4-awq@self") == d / "nvfp4-awq_self.jsonl"
    with pytest.raises(SystemExit):  # same file name from two directories: refused before anything loads
        methods.main(["--rows", "nvfp4-awq@/a/t.jsonl,nvfp4-awq@/b/t.jsonl", "--keep-completions", "/tmp/k"])


def test_kept_completions_are_eval_records(tiny_dir, tmp_path):
    problems = tmp_path / "test.jsonl"
    problems.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                                for a in (1, 2, 3)))
    keep, out = tmp_path / "kept", tmp_path / "qm.json"
    assert methods.main(["--model", str(tiny_dir), "--test", str(problems), "--limit", "3", "--n", "1",
                         "--temperature", "0", "--max-new-tokens", "6", "--rows", "bf16,nvfp4#last:1",
                         "--keep-completions", str(keep), "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [Path(r["completions"]).name for r in results] == ["bf16.jsonl", "nvfp4_last_1.jsonl"]
    for r in results:
        rows = forms.read_run(Path(r["completions"]))
        assert [row["question"] for row in rows] == [f"What is {a} + {a}?" for a in (1, 2, 3)]
        assert all(len(row["completions"]) == len(row["lengths"]) == 1 for row in rows)
        assert all(0 < row["lengths"][0] <= 6 for row in rows)
        mean = sum(row["rewards"][0] or 0.0 for row in rows) / len(rows)
        assert abs(mean - r["pass1"]) < 1e-9  # the kept records are the ones the row's pass@1 was scored on
