"""Data sources (offline ones for real, the hub ones by their offline behaviour), local files, bad rows,
prompt templates with a real chat template."""

import json
import sys

import pytest

from qerl.data import BOXED_SUFFIX, GSM8K_SUFFIX, DatasetError, build_prompt, encode_prompt, filter_by_length, load_problems
from tiny import tiny_tokenizer


def test_gsm8k_offline_is_the_test_split(caplog):
    rows = load_problems("gsm8k-offline", split="test")
    assert len(rows) == 1319 and rows[0]["answer"].endswith("#### 18") and not caplog.text
    load_problems("gsm8k-offline", split="train", limit=3)
    assert "TEST split" in caplog.text


def test_aime2025():
    rows = load_problems("aime2025")
    assert len(rows) == 30 and rows[0]["answer"] == "70" and {r["part"] for r in rows} == {"I", "II"}


def test_reasoning_gym_defaults_overrides_and_splits():
    rows = load_problems("reasoning-gym:basic_arithmetic", limit=50)
    assert len(rows) == 50 and all(r["task"] == "basic_arithmetic" for r in rows)
    assert all(int(r["answer"]) == eval(r["metadata"]["expression"]) for r in rows)  # small +/- sums
    again = load_problems("reasoning-gym:basic_arithmetic", limit=50)
    assert again == rows  # deterministic for a seed
    test = load_problems("reasoning-gym:basic_arithmetic", split="test", limit=50)
    assert [r["question"] for r in test] != [r["question"] for r in rows]
    big = load_problems("reasoning-gym:chain_sum?size=5&seed=3&min_digits=3&max_digits=3")
    assert len(big) == 5 and all(len(n) == 3 for r in big for n in r["metadata"]["expression"].split(" ")[::2])
    assert load_problems("reasoning-gym", limit=2)[0]["task"] == "basic_arithmetic"


def test_reasoning_gym_errors():
    with pytest.raises(DatasetError, match="unknown task 'nope'"):
        load_problems("reasoning-gym:nope")
    with pytest.raises(DatasetError, match="bad settings"):
        load_problems("reasoning-gym:chain_sum?min_terms=9&max_terms=2")


def test_hub_sources_offline(monkeypatch):
    """Without network the hub sources fail with a message naming the offline alternatives."""
    import datasets

    def no_network(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    for source in ("gsm8k", "bigmath"):
        with pytest.raises(DatasetError, match="offline alternatives: gsm8k-offline"):
            load_problems(source)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DatasetError, match="needs the `datasets` package"):
        load_problems("gsm8k")


def test_hub_rows_are_mapped(monkeypatch):
    """Big-Math's columns (problem, answer, ...) become question/answer, the rest is kept."""
    import datasets

    class Fake:
        def to_list(self):
            return [{"problem": "1+1?", "answer": "2", "source": "x", "llama8b_solve_rate": 0.5}]

    monkeypatch.setattr(datasets, "load_dataset", lambda repo, config, split: Fake())
    assert load_problems("bigmath") == [{"question": "1+1?", "answer": "2", "source": "x", "llama8b_solve_rate": 0.5}]


def _write_jsonl(path, lines):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_local_jsonl_json_parquet(tmp_path):
    recs = [{"question": "What is 2+2?", "answer": "4", "level": 1}, {"question": "3*3?", "answer": 9, "level": 2}]
    jl = _write_jsonl(tmp_path / "a.jsonl", [json.dumps(r).encode() for r in recs])
    expected = [{"question": "What is 2+2?", "answer": "4", "level": 1}, {"question": "3*3?", "answer": "9", "level": 2}]
    assert load_problems(jl) == expected
    (tmp_path / "a.json").write_text(json.dumps(recs))
    assert load_problems(str(tmp_path / "a.json")) == expected
    (tmp_path / "cols.json").write_text(json.dumps({"question": ["What is 2+2?", "3*3?"], "answer": ["4", 9],
                                                    "level": [1, 2]}))
    assert load_problems(str(tmp_path / "cols.json")) == expected
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"problem": "p", "solution": "\\boxed{1}"}]), tmp_path / "a.parquet")
    assert load_problems(str(tmp_path / "a.parquet")) == [{"question": "p", "answer": "\\boxed{1}"}]
    assert load_problems(jl, limit=1) == expected[:1]


def test_custom_column_names_and_wrong_ones(tmp_path):
    jl = _write_jsonl(tmp_path / "q.jsonl", [b'{"instruction": "2+2?", "gold": "4"}'])
    assert load_problems(jl, question_key="instruction", answer_key="gold") == [{"question": "2+2?", "answer": "4"}]
    with pytest.raises(DatasetError, match=r"no question column .*columns are \['gold', 'instruction'\]"):
        load_problems(jl)
    with pytest.raises(DatasetError, match="no answer column 'ans'"):
        load_problems(jl, question_key="instruction", answer_key="ans")


def test_bad_rows_are_skipped_counted_and_named(tmp_path, caplog):
    jl = _write_jsonl(tmp_path / "bad.jsonl", [
        b'{"question": "ok?", "answer": "1"}',
        b'{"question": "", "answer": "1"}',            # empty question
        b'{"question": "no answer"}',                   # missing answer
        b'{"question": ["list"], "answer": "1"}',       # wrong type
        b'{"question": "bool?", "answer": true}',       # wrong type
        b'{"question": "caf\xe9", "answer": "1"}',      # latin-1 byte: not UTF-8
        b'{not json',
        b'[1, 2]',                                      # not an object
    ])
    rows = load_problems(jl)
    assert rows == [{"question": "ok?", "answer": "1"}]
    assert "skipped 7 of 7 rows" not in caplog.text and "skipped 7" in caplog.text
    for needle in ("line 6: not UTF-8", "line 7: invalid JSON", "row 1: 'question'", "row 2: 'answer' is missing"):
        assert needle in caplog.text, needle


def test_empty_and_unreadable_files(tmp_path):
    empty = _write_jsonl(tmp_path / "empty.jsonl", [b""])
    with pytest.raises(DatasetError, match="empty.jsonl: no records"):
        load_problems(empty)
    allbad = _write_jsonl(tmp_path / "allbad.jsonl", [b'{"question": "", "answer": "1"}'])
    with pytest.raises(DatasetError, match="allbad.jsonl: no usable rows"):
        load_problems(allbad)
    (tmp_path / "x.json").write_bytes(b"\xff\xfe")
    with pytest.raises(DatasetError, match="x.json: not UTF-8"):
        load_problems(str(tmp_path / "x.json"))
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="x.parquet: not a readable parquet"):
        load_problems(str(tmp_path / "x.parquet"))
    with pytest.raises(DatasetError, match="no such file"):
        load_problems(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="unknown dataset 'gsm9k'"):
        load_problems("gsm9k")


def test_plain_template_with_the_tiny_tokenizer():
    tok = tiny_tokenizer()
    assert build_prompt(" 2+2? ", tok) == f"2+2?\n{GSM8K_SUFFIX}\n"
    assert build_prompt("2+2?", tok, suffix="boxed", system="Be brief.") == f"Be brief.\n\n2+2?\n{BOXED_SUFFIX}\n"
    assert build_prompt("2+2?", None, suffix=None) == "2+2?\n"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from qerl.models.registry import embedded_hf_dir

    return AutoTokenizer.from_pretrained(embedded_hf_dir("smollm2-135m-instruct"))


def test_chat_template_smollm2(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = build_prompt("What is 2+2?", tok, suffix="gsm8k", system="You are a math tutor.")
    assert text == ("<|im_start|>system\nYou are a math tutor.<|im_end|>\n<|im_start|>user\nWhat is 2+2?\n"
                    f"{GSM8K_SUFFIX}<|im_end|>\n<|im_start|>assistant\n")
    ids = encode_prompt(text, tok)
    assert tok.decode(ids) == text and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_filter_by_length(smollm2_tokenizer, caplog):
    rows = [{"question": "1+1?", "answer": "2"}, {"question": "word " * 300, "answer": "3"}]
    kept = filter_by_length(rows, smollm2_tokenizer, max_prompt_tokens=128)
    assert kept == rows[:1] and "dropped 1 of 2 problems" in caplog.text
    with pytest.raises(DatasetError, match="every one of the 2 prompts"):
        filter_by_length(rows, smollm2_tokenizer, max_prompt_tokens=5)
