"""evaluate / qerl eval: end to end on a tiny random model (fast) and the real SmolLM2 (slow)."""

import argparse
import json

import pytest

from qerl.eval import add_eval_arguments, evaluate, run_eval
from qerl.rollout.sampling import SamplingParams
from tiny import tiny_model, tiny_tokenizer

ROWS = [{"question": "1+1?", "answer": "2"}, {"question": "2+3?", "answer": "#### 5"},
        {"question": "7?", "answer": "7"}]


def reward_by_length(prompts, completions, answer, **columns):
    """Deterministic stand-in reward for a random model: 1.0 when the completion has an even length."""
    return [float(len(c) % 2 == 0) for c in completions]


def test_evaluate_tiny_model_sampled():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    out = evaluate(model, tok, ROWS, n_samples=3, sampling=SamplingParams(0.6, top_p=0.95), max_new_tokens=8,
                   batch_size=4, reward=reward_by_length, progress=False)
    assert out["n_problems"] == 3 and out["n_samples"] == 3
    per = out["per_problem"]
    assert [p["question"] for p in per] == [r["question"] for r in ROWS]
    assert all(len(p["completions"]) == len(p["rewards"]) == 3 for p in per)
    expected = sum(sum(float(len(c) % 2 == 0) for c in p["completions"]) / 3 for p in per) / 3
    assert out["pass@1"] == pytest.approx(expected)
    assert out["mean_length"] <= 8 and 0 <= out["truncated"] <= 1
    again = evaluate(model, tok, ROWS, n_samples=3, sampling=SamplingParams(0.6, top_p=0.95), max_new_tokens=8,
                     batch_size=4, reward=reward_by_length, progress=False)
    assert [p["completions"] for p in again["per_problem"]] == [p["completions"] for p in per]  # seeded


def test_evaluate_greedy_is_one_sample_and_math_reward_scores():
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    out = evaluate(model, tok, ROWS, n_samples=4, sampling=SamplingParams(0.0), max_new_tokens=6,
                   progress=False)
    assert out["n_samples"] == 1
    # a random model's text essentially never holds the answer: whatever it wrote, math_reward decided
    from qerl.rewards import math_reward

    for p, r in zip(out["per_problem"], ROWS):
        assert p["rewards"] == math_reward([""], p["completions"], [r["answer"]])


class ScriptedEngine:
    """Stand-in engine that answers with fixed completions, in job order (problem-major, then sample)."""

    def __init__(self, texts):
        self.texts = list(texts)

    def generate(self, prompts, max_new_tokens, sampling, seed=0):
        import torch
        from types import SimpleNamespace

        texts, self.texts = self.texts[:len(prompts)], self.texts[len(prompts):]
        return SimpleNamespace(texts=texts, lengths=torch.tensor([len(t) for t in texts]),
                               finish_reason=["stop"] * len(texts))


SCRIPT = ["#### 18", "The answer is 18.", "\\boxed{5}", "Let me think about"]
TWO_ROWS = [{"question": "q1", "answer": "9 * 2 = 18\n#### 18"}, {"question": "q2", "answer": "5"}]


@pytest.mark.parametrize("suffix,strict,format_followed", [
    # gsm8k asks for ####: only "#### 18" is strictly right and in format -> strict (1/2 + 0) / 2
    ("gsm8k", [[1.0, 0.0], [0.0, 0.0]], 0.25),
    # boxed asks for \boxed{}: only "\boxed{5}" -> strict (0 + 1/2) / 2
    ("boxed", [[0.0, 0.0], [1.0, 0.0]], 0.25),
    # none asks for no style: any marker is strict, any style's format counts
    ("none", [[1.0, 0.0], [1.0, 0.0]], 0.5),
])
def test_evaluate_reports_flexible_and_strict_scores(suffix, strict, format_followed):
    from qerl.eval.evaluate import summary_table

    out = evaluate(None, tiny_tokenizer(), TWO_ROWS, n_samples=2, sampling=SamplingParams(0.6), suffix=suffix,
                   engine=ScriptedEngine(SCRIPT), progress=False)
    assert [p["rewards"] for p in out["per_problem"]] == [[1.0, 1.0], [1.0, 0.0]]
    assert out["pass@1"] == pytest.approx(0.75)  # flexible: (1 + 1/2) / 2, as before
    assert [p["strict"] for p in out["per_problem"]] == strict
    assert out["pass@1_strict"] == pytest.approx(sum(sum(s) / 2 for s in strict) / 2)
    assert out["no_answer"] == pytest.approx(0.25)  # "Let me think about" holds no number
    assert out["format_followed"] == pytest.approx(format_followed)
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(summary_table(out, "t"))
    text = console.export_text()
    assert "pass@1 strict" in text and "no extractable answer" in text and "25.0%" in text


def test_a_custom_reward_gets_no_strict_scores():
    out = evaluate(None, tiny_tokenizer(), TWO_ROWS, n_samples=2, sampling=SamplingParams(0.6),
                   engine=ScriptedEngine(SCRIPT), reward=reward_by_length, progress=False)
    assert not {"pass@1_strict", "no_answer", "format_followed"} & out.keys()
    assert all("strict" not in p for p in out["per_problem"])


def test_run_eval_command(tmp_path, monkeypatch, capsys):
    """qerl eval end to end on a tiny model saved to disk, quantized to NVFP4 on load, JSONL out."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    data = tmp_path / "p.jsonl"
    # one malformed line in four is over the default share of bad rows; --max-bad-fraction lets it through
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "{not json\n")
    args = add_eval_arguments(argparse.ArgumentParser()).parse_args(
        [str(tmp_path / "m"), "--dataset", str(data), "--n", "2", "--max-new-tokens", "5", "--format", "nvfp4",
         "--dtype", "fp32", "--device", "cpu", "--out", str(tmp_path / "res.jsonl"), "--max-bad-fraction", "0.25"])
    assert run_eval(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["n_problems"] == 3 and summary["n_samples"] == 2 and 0 <= summary["pass@1"] <= 1
    assert all(0 <= summary[k] <= 1 for k in ("pass@1_strict", "no_answer", "format_followed"))
    lines = [json.loads(x) for x in (tmp_path / "res.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(len(x["completions"]) == len(x["strict"]) == 2 for x in lines)
    # --dense-weights: the same completions from 16-bit copies of the NF4 weights (exact dequantization)
    import importlib

    ev = importlib.import_module("qerl.eval.evaluate")  # the module (the package exports a function of that name)

    stores = []

    class Spy(ev.RolloutEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            stores.append(self.dense_weights)

    monkeypatch.setattr(ev, "RolloutEngine", Spy)
    outs = []
    for extra in ([], ["--dense-weights"]):
        args = add_eval_arguments(argparse.ArgumentParser()).parse_args(
            [str(tmp_path / "m"), "--dataset", str(data), "--n", "2", "--max-new-tokens", "5", "--format", "nf4",
             "--dtype", "fp32", "--device", "cpu", "--out", str(tmp_path / "d.jsonl"), "--max-bad-fraction", "0.25",
             "--overwrite", *extra])  # the second run replaces the first one's results
        assert run_eval(args) == 0
        outs.append([json.loads(x)["completions"] for x in (tmp_path / "d.jsonl").read_text().splitlines()])
    assert outs[0] == outs[1]
    assert stores[0] is None and stores[1]  # the second engine decoded from copies, made on first use


def test_qerl_eval_refuses_a_mostly_malformed_dataset(tmp_path, capsys):
    """Before: "skipped 2 of 1 rows", then an evaluation of the one row left and exit 0."""
    from qerl.cli import main

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n{broken\n[1,\n")
    # the data is checked before the model loads: no model is needed to see the refusal
    assert main(["eval", str(tmp_path / "no-model"), "--dataset", str(data)]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and f"{data}: 2 of 3 rows are bad, more than max_bad_fraction=0.1" in " ".join(err.split())
    assert "line 2: invalid JSON" in err and "no-model" not in err


def test_evaluate_rejects_no_rows():
    with pytest.raises(ValueError, match="no problems"):
        evaluate(tiny_model(), tiny_tokenizer(), [], progress=False)


@pytest.mark.slow
def test_smollm2_gsm8k_greedy():
    """The real SmolLM2-135M-Instruct on 8 GSM8K test problems, greedy: runs end to end; every reward is
    what math-verify says of the completion; at this size accuracy is low (a few %), so only bounds."""
    from qerl.data import load_problems
    from qerl.models import load_causal_lm

    model, tok = load_causal_lm("smollm2-135m-instruct", dtype="bf16", device="cpu")
    rows = load_problems("gsm8k-offline", split="test", limit=8)
    out = evaluate(model, tok, rows, sampling=SamplingParams(0.0), max_new_tokens=200, progress=False)
    assert out["n_problems"] == 8 and 0.0 <= out["pass@1"] <= 0.5
    assert out["mean_length"] > 20  # it writes a solution, not nothing
    assert all(r in (0.0, 1.0) for p in out["per_problem"] for r in p["rewards"])


def test_qerl_eval_keeps_layers_in_bf16_as_the_trained_policy_had_them(tmp_path, capsys):
    """--keep-bf16 rebuilds the policy a config with model.keep_bf16 trained (e.g. last:2 at 1.5B)."""
    from qerl.cli import main
    from qerl.eval.evaluate import prepare_model
    from qerl.models import quant_layers

    model, tok = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    base = [str(tmp_path / "m"), "--dataset", "unused", "--dtype", "fp32", "--device", "cpu"]
    args = add_eval_arguments(argparse.ArgumentParser()).parse_args(
        base + ["--format", "nvfp4", "--keep-bf16", "last:1"])
    m, _ = prepare_model(args)
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    formats = {name: layer.weight_format for name, layer in quant_layers(m).items()}
    assert formats and all((f == "bf16") == name.startswith(last) for name, f in formats.items()), formats
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["eval", str(tmp_path / "m"), "--dataset", str(data), "--n", "1", "--max-new-tokens", "3", "--dtype",
                 "fp32", "--device", "cpu", "--format", "nvfp4", "--keep-bf16", "last:1"]) == 0
    assert "base nvfp4 with last:1 in bf16" in " ".join(capsys.readouterr().err.split())
    # refused before anything loads: no 4-bit format to keep layers out of, or a malformed pattern
    for extra, message in ((["--keep-bf16", "last:2"], "needs --format nvfp4"),
                           (["--format", "nvfp4", "--keep-bf16", "last:0"], "--keep-bf16: ")):
        assert main(["eval", str(tmp_path / "absent"), "--dataset", str(data), *extra]) == 2
        assert message in capsys.readouterr().err

