"""experiments/lora_grad_agreement.py on a tiny random model: one LoRA initialisation on both bases, finite
cosines in [-1, 1], the solution tokens alone in the loss."""

import pytest
from bench_scripts import load_experiment
from tiny import tiny_model, tiny_tokenizer


def test_grad_agreement_table_on_a_tiny_model(tmp_path, capsys):
    grads = load_experiment("lora_grad_agreement")
    model, tok = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    ids, mask = grads.problem_batch(tok, [{"question": "1+1?", "answer": "2\n#### 2"},
                                         {"question": "2+2?", "answer": "It is 4.\n#### 4"}])
    assert mask.sum(1).tolist() == [9.0, 16.0]  # the answer's characters and EOS, nothing of the prompt
    assert (ids[0, mask[0] == 0][-3:] == tok.pad_token_id).all()  # the shorter row is right-padded
    assert grads.main(["--model", str(tmp_path / "m"), "--problems", "1", "--r", "4"]) == 0
    table = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| set")]
    assert len(table) == 2
    for row in table:
        cos, ratio = float(row[2]), float(row[4])
        assert -1.0 <= cos <= 1.0 and ratio > 0  # NaN fails both
    a = {"w": ids[:1].float()}
    assert grads.cosine(a, a) == pytest.approx(1.0)
    with pytest.raises(SystemExit):
        grads.main(["--model", str(tmp_path / "m"), "--format", "bf16"])
