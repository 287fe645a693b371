"""benchmarks/base_gap.py on a tiny random Qwen2 with a random adapter: the 4-bit policy differs from the 16-bit one
(KL > 0), taking every decoder layer from the 16-bit model removes the difference exactly, the layer swap is undone,
and the whole script writes a consistent report."""

import json

import pytest
import torch
from bench_scripts import load_benchmark

from qerl.models import lora_parameters, save_adapter
from qerl.models.loader import ModelSpec, load_policy
from qerl.nn import LoraConfig

gap = load_benchmark("base_gap")


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir, tmp_path_factory):
    model, _ = load_policy(ModelSpec(name=str(tiny_dir), format="bf16", lora=LoraConfig(r=4, alpha=8), device="cpu"))
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    save_adapter(model, out, base_model_name_or_path=str(tiny_dir))
    return out


@pytest.mark.parametrize("a,b,expected", [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1),
                                          ([1, 2], [1, 2, 3], 2), ([], [4], 0), ([], [], None)])
def test_first_divergence(a, b, expected):
    assert gap.first_divergence(a, b) == expected


def test_the_16bit_layers_remove_the_4bit_difference_exactly(tiny_dir, adapter_dir):
    spec = dict(name=str(tiny_dir), adapter=str(adapter_dir), device="cpu")
    full, _ = load_policy(ModelSpec(format="bf16", **spec))
    quantized, _ = load_policy(ModelSpec(format="nvfp4", **spec))
    prompt, completion = [5, 9, 14, 3], [20, 31, 7, 7, 12]
    references = [(prompt, completion, gap.next_token_logprobs(full, prompt, completion))]
    kl, agree = gap.kl_and_agreement(references[0][2], references[0][2])
    assert torch.equal(kl, torch.zeros_like(kl)) and agree.all()
    none = gap.mean_kl(quantized, references)
    assert none > 1e-6
    layers = list(range(len(gap.decoder_layers(quantized))))
    before = list(gap.decoder_layers(quantized))
    with gap.layers_from(quantized, full, layers):
        assert gap.mean_kl(quantized, references) < 1e-9
    assert list(gap.decoder_layers(quantized)) == before  # swapped back
    sweep = gap.layer_sweep(quantized, full, references)
    assert sweep["none"] == pytest.approx(none) and len(sweep["per_layer"]) == len(layers)
    assert all(0 <= kl < none for kl in sweep["per_layer"])  # either layer alone in 16-bit helps
    assert sweep["top"][-1]["kl"] < 1e-9  # top 2 = every layer of the tiny model


def test_the_script_reports_every_problem(tiny_dir, adapter_dir, tmp_path, capsys):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a, b in ((2, 3), (10, 7), (4, 4))))
    out = tmp_path / "gap.json"
    assert gap.main([str(tiny_dir), "--adapter", str(adapter_dir), "--dataset", str(data), "--max-new-tokens", "6",
                     "--layer-problems", "2", "--keep-sweep", "1,2", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["problems"] == len(result["problems"]) == 3
    neither = sum(not p["flexible_16bit"] and not p["flexible_4bit"] for p in result["problems"])
    assert s["both"] + s["only_16bit"] + s["only_4bit"] + neither == 3
    assert all(1 <= p["length_16bit"] <= 6 and 1 <= p["length_4bit"] <= 6 for p in result["problems"])
    assert result["positions"] and result["positions"][0]["from"] == 0
    assert result["layers"]["none"] > 0 and len(result["layers"]["per_layer"]) == 2
    # the keep sweep: its top layer first; with both layers of the tiny model from the 16-bit one, the 16-bit score
    sweep = result["keep_sweep"]
    assert [t["k"] for t in sweep] == [1, 2] and len(sweep[0]["layers"]) == 1
    assert sweep[1]["pass1"] == s["pass1_16bit"] and sweep[1]["pass1_strict"] == s["pass1_strict_16bit"]
    assert "KL(16-bit ‖ 4-bit)" in capsys.readouterr().out
