"""Data sources (offline ones for real, the hub ones by their offline behaviour), local files, bad rows,
prompt templates with a real chat template."""

import json
import sys

import pytest

from qerl.data import (BOXED_SUFFIX, GSM8K_SUFFIX, DatasetError, build_prompt, encode_prompt, filter_by_length,
                       load_problems)
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
    expected = [{"question": "What is 2+2?", "answer": "4", "level": 1},
                {"question": "3*3?", "answer": "9", "level": 2}]
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
    rows = load_problems(jl, max_bad_fraction=1.0)  # 1.0: skip and warn, never refuse
    assert rows == [{"question": "ok?", "answer": "1"}]
    # the total counts the two unparseable lines too (they never became records)
    assert "skipped 7 of 8 rows" in caplog.text
    # every problem is named by its 1-based file line, parsed or not (a 0-based "row" beside them misleads)
    for needle in ("line 6: not UTF-8", "line 7: invalid JSON", "line 2: 'question'", "line 3: 'answer' is missing"):
        assert needle in caplog.text, needle


def _mixed_jsonl(path, n_good, n_unparseable, n_invalid):
    """n_good usable rows, n_unparseable lines that are not JSON, n_invalid rows with an empty question."""
    lines = [json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}).encode() for i in range(n_good)]
    lines += [b"{broken"] * n_unparseable + [b'{"question": "", "answer": "1"}'] * n_invalid
    return _write_jsonl(path, lines)


def test_bad_row_count_includes_unparseable_lines(tmp_path, caplog):
    # the old message divided by the parsed records only: "skipped 2 of 1 rows"
    jl = _mixed_jsonl(tmp_path / "m.jsonl", n_good=1, n_unparseable=2, n_invalid=0)
    with pytest.raises(DatasetError, match=r"m\.jsonl: 2 of 3 rows are bad, more than max_bad_fraction=0\.1; "
                                           r"first: line 2: invalid JSON .*; line 3: invalid JSON"):
        load_problems(jl)
    assert len(load_problems(jl, max_bad_fraction=1.0)) == 1
    assert "skipped 2 of 3 rows" in caplog.text


def test_too_many_bad_rows_refuse_the_source(tmp_path, caplog):
    # 2 bad of 19 (10.5%) is over the default 10%; 1 unparseable + 1 invalid so both kinds count
    over = _mixed_jsonl(tmp_path / "over.jsonl", n_good=17, n_unparseable=1, n_invalid=1)
    with pytest.raises(DatasetError, match=r"over\.jsonl: 2 of 19 rows are bad") as err:
        load_problems(over)
    assert "\n" not in str(err.value) and "line 18: invalid JSON" in str(err.value) and "line 19" in str(err.value)
    # the share is of the whole file, whatever `limit` keeps
    with pytest.raises(DatasetError, match="2 of 19 rows are bad"):
        load_problems(over, limit=5)
    assert len(load_problems(over, max_bad_fraction=0.2)) == 17
    # below the share: skipped with the warning
    caplog.clear()
    under = _mixed_jsonl(tmp_path / "under.jsonl", n_good=19, n_unparseable=1, n_invalid=0)
    assert len(load_problems(under)) == 19
    assert "under.jsonl: skipped 1 of 20 rows; first: line 20: invalid JSON" in caplog.text
    # max_bad_fraction=0: any bad row refuses; a clean file still loads
    with pytest.raises(DatasetError, match="1 of 20 rows are bad, more than max_bad_fraction=0;"):
        load_problems(under, max_bad_fraction=0)
    assert len(load_problems(_mixed_jsonl(tmp_path / "clean.jsonl", 3, 0, 0), max_bad_fraction=0)) == 3
    for wrong in (-0.1, 1.5, float("nan")):
        with pytest.raises(DatasetError, match="max_bad_fraction must be in"):
            load_problems(under, max_bad_fraction=wrong)


@pytest.mark.parametrize("n_good,n_bad,fraction", [(9, 1, 0.1), (18, 2, 0.1), (27, 63, 0.7)])
def test_exactly_the_allowed_share_of_bad_rows_is_accepted(tmp_path, caplog, n_good, n_bad, fraction):
    # bad / total == fraction is allowed; 63 of 90 at 0.7 also catches a bad > fraction * total check,
    # since 0.7 * 90 is 62.99999999999999 in floats
    jl = _mixed_jsonl(tmp_path / "edge.jsonl", n_good=n_good, n_unparseable=n_bad, n_invalid=0)
    assert len(load_problems(jl, max_bad_fraction=fraction)) == n_good
    assert f"skipped {n_bad} of {n_good + n_bad} rows" in caplog.text
    # one more bad row is over it
    jl = _mixed_jsonl(tmp_path / "edge1.jsonl", n_good=n_good, n_unparseable=n_bad, n_invalid=1)
    with pytest.raises(DatasetError, match=f"{n_bad + 1} of {n_good + n_bad + 1} rows are bad"):
        load_problems(jl, max_bad_fraction=fraction)


def test_the_bad_share_applies_to_hub_sources_too(monkeypatch):
    # normalize_rows is shared by every source: a hub dataset with mostly empty answers is refused too
    from qerl.data import datasets

    raw = [{"problem": "p", "answer": "1"}] + [{"problem": "p", "answer": ""}] * 2
    monkeypatch.setattr(datasets, "load_hub", lambda source, split: raw)
    with pytest.raises(DatasetError, match="bigmath: 2 of 3 rows are bad"):
        load_problems("bigmath")
    assert load_problems("bigmath", max_bad_fraction=1.0) == [{"question": "p", "answer": "1"}]


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


def test_training_refuses_a_mostly_malformed_file_unless_data_max_bad_fraction_allows(tiny_dir, tmp_path,
                                                                                    monkeypatch):
    from qerl.config import load_config
    from qerl.rl.trainer import Trainer

    class ModelLoad(Exception):
        pass

    def no_model(*args, **kwargs):  # reached only when the data was accepted
        raise ModelLoad

    monkeypatch.setattr("qerl.rl.trainer.build_policy", no_model)
    data = _mixed_jsonl(tmp_path / "train.jsonl", n_good=3, n_unparseable=1, n_invalid=0)  # 25% bad
    base = [f"model.name={tiny_dir}", f"data.train={data}", f"output_dir={tmp_path / 'run'}", "tensorboard=false"]
    with pytest.raises(DatasetError, match="train.jsonl: 1 of 4 rows are bad, more than max_bad_fraction=0.1"):
        Trainer(load_config(None, base))
    with pytest.raises(ModelLoad):
        Trainer(load_config(None, [*base, "data.max_bad_fraction=0.25"]))
