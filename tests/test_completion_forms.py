"""benchmarks/completion_forms.py on hand-written `qerl eval --out` files: every completion scored again with the
real math-verify, the per-model shares and, per pair, what the other model did where only one was right."""

import json

from bench_scripts import load_benchmark

QUESTIONS = [("Tom has 3 bags of 6 apples. How many?", "18"), ("2 + 3?", "5"), ("4 + 3?", "7")]
RUNS = {  # (completion, tokens) per problem, greedy: one completion each
    "a": [("3 bags of 6 is 18.\n#### 18", 20), ("2 + 3 = 5\n#### 5", 12), ("I think 3", 5)],
    "b": [("The answer is \\boxed{18}", 9), ("Let me think step by step about the", 512), ("4 + 3 = 7\n#### 7", 11)],
    "c": [("```python\nprint(3 * 6)\n```\nOutput: 17\n#### 17", 14), ("so \\boxed{4}", 6),
          ("```\nx = 4 + 3\n```\n#### 7", 4)],
}


def _write(tmp_path, name, runs=RUNS, questions=QUESTIONS):
    path = tmp_path / f"{name}.jsonl"
    with open(path, "w") as f:
        for (q, ans), (text, n) in zip(questions, runs[name]):
            f.write(json.dumps({"question": q, "answer": ans, "completions": [text], "rewards": [None],
                                "lengths": [n]}) + "\n")
    return path


def test_shares_and_what_the_other_model_did(tmp_path, capsys):
    mod = load_benchmark("completion_forms")
    paths = [_write(tmp_path, n) for n in RUNS]
    assert mod.main([*map(str, paths), "--max-new-tokens", "512", "--out", str(tmp_path / "forms.json")]) == 0
    out = json.loads((tmp_path / "forms.json").read_text())
    a, b, c = (out["summaries"][n] for n in RUNS)
    assert (a["pass@1"], a["pass@1_strict"]) == (2 / 3, 2 / 3)
    assert (b["pass@1"], b["pass@1_strict"]) == (2 / 3, 1 / 3)  # a boxed answer is right, not in the asked format
    assert b["no_answer"] == 1 / 3 and b["cut"] == 1 / 3 and a["cut"] == 0
    assert b["markers"] == {"gsm8k": 1 / 3, "boxed": 1 / 3, "answer_tag": 0, "none": 1 / 3}
    assert c["pass@1"] == 1 / 3
    ab, ac = out["pairs"]["a vs b"], out["pairs"]["a vs c"]
    assert (ab["both"], ab["neither"]) == (1, 0)
    assert ab["only_a"] == {"cut off, no answer": 1} and ab["only_b"] == {"wrong, other marker": 1}
    assert ab["problems"]["a"]["cut off, no answer"] == [1]
    assert ac["only_a"] == {"wrong, same marker": 1, "wrong, other marker": 1} and ac["only_b"] == {
        "wrong, other marker": 1}
    table = capsys.readouterr().out
    assert "| a vs b | 1 | 0 | 1 | 1 | 1 / 0 / 0 / 0 | 0 / 0 / 0 / 1 | 0 / 0 |" in table
    # the solution's form: c wrote code twice (wrong once, right once), a and b never
    assert (c["code"], c["pass@1_code"], c["pass@1_prose"]) == (2 / 3, 1 / 2, 0.0)
    assert (a["code"], a["pass@1_code"], a["pass@1_prose"]) == (0.0, None, 2 / 3)
    assert ac["only_a_prose_over_code"] == 1 and ac["only_b_prose_over_code"] == 0  # problem 0: a in prose, c in code
    # by form: problems 0 and 2 went prose -> code (a right on 0, c right on 2), problem 1 stayed prose (a right)
    assert ac["forms"] == {"prose -> code": {"problems": 2, "right_a": 1, "right_b": 1},
                           "prose -> prose": {"problems": 1, "right_a": 1, "right_b": 0}}
    assert "| a vs c | prose -> code: 2, 1 -> 1; prose -> prose: 1, 1 -> 0 |" in table


def test_a_code_block_is_a_fence_on_its_own_line():
    mod = load_benchmark("completion_forms")
    assert mod.writes_code("Let's compute.\n```python\nx = 1\n```")
    assert mod.writes_code("```\nx = 1\n```") and mod.writes_code("  ```Python\nx\n```")
    assert not mod.writes_code("The answer is `18`, written ``` inline ```python") and not mod.writes_code("#### 18")
    # fences pair up: a closing fence is never an opening, and other languages are not code
    assert not mod.writes_code("```json\n{\"a\": 1}\n```\nso 18") and not mod.writes_code("```text\n18\n```")
    assert mod.writes_code("```text\nplan\n```\nthen\n```python\nprint(1)\n```")


def test_runs_of_other_problems_or_broken_files_are_refused(tmp_path, capsys):
    mod = load_benchmark("completion_forms")
    other = [(q + " (changed)", ans) for q, ans in QUESTIONS]
    a, b = _write(tmp_path, "a"), _write(tmp_path, "b", questions=other)
    assert mod.main([str(a), str(b)]) == 2
    assert "b: not the problems of a in the same order" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    assert mod.main([str(a), str(bad)]) == 2
    assert "bad.jsonl:1: not a `qerl eval --out` record" in capsys.readouterr().err
