"""An adapter trained on a 4-bit base, served on the 16-bit model: `qerl merge` (PEFT's merge, written as a plain
Hugging Face directory) and `qerl eval --adapter` without --format (the study's --eval-16bit-base), both the
base's logits with W + scaling * B A in every targeted linear."""

import argparse
import copy
import json

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from qerl.cli import main
from qerl.models import quant_layers, quantize_model, save_adapter
from qerl.nn.lora import LoraConfig


@pytest.fixture
def trained(tmp_path):
    """(base dir, adapter dir, the fp32 base model, {module name: fp32 delta [out, in]})."""
    torch.manual_seed(0)
    model, tok = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    q = copy.deepcopy(model)
    quantize_model(q, "nvfp4", lora=LoraConfig(r=4, alpha=8.0))
    deltas = {}
    for name, layer in quant_layers(q).items():  # a trained adapter: B is no longer zero
        torch.nn.init.normal_(layer.lora_B.weight, std=0.05)
        deltas[name] = layer.scaling * layer.lora_B.weight.detach() @ layer.lora_A.weight.detach()
    save_adapter(q, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    return tmp_path / "base", tmp_path / "adapter", model, deltas


def test_merge_writes_the_16bit_model_plus_the_adapter(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    base_dir, adapter, model, deltas = trained
    out = tmp_path / "merged"
    assert main(["merge", str(adapter), "--out", str(out), "--dtype", "fp32"]) == 0  # the base named by the adapter
    assert "merged into" in capsys.readouterr().err
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())  # a plain model, nothing of PEFT left
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / "tokenizer_config.json").is_file()

    reference = copy.deepcopy(model).eval()
    modules = dict(reference.named_modules())
    for name, delta in deltas.items():
        modules[name].weight.data += delta
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        got, want = merged(input_ids=ids).logits, reference(input_ids=ids).logits
        base = model.eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert (got - base).abs().max() > 1e-3  # the adapter changed the model

    # bf16 by default; an existing --out is refused, --overwrite replaces it
    assert main(["merge", str(adapter), "--out", str(out), "--model", str(base_dir)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["merge", str(adapter), "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text()).get("dtype", json.loads(
        (out / "config.json").read_text()).get("torch_dtype")) == "bfloat16"


def test_merge_refuses_what_it_cannot_merge(trained, tmp_path, capsys):
    from qerl.models import save_quantized

    base_dir, adapter, model, _ = trained
    assert main(["merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err
    q = copy.deepcopy(model)
    quantize_model(q, "nvfp4")
    save_quantized(q, tiny_tokenizer(), tmp_path / "q")
    assert main(["merge", str(adapter), "--out", str(tmp_path / "o"), "--model", str(tmp_path / "q")]) == 2
    assert "is a quantized checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_eval_without_format_serves_the_adapter_on_the_16bit_model(trained):
    from qerl.eval import add_eval_arguments
    from qerl.eval.evaluate import prepare_model

    base_dir, adapter, model, deltas = trained
    args = add_eval_arguments(argparse.ArgumentParser()).parse_args(
        [str(base_dir), "--dataset", "unused", "--dtype", "fp32", "--device", "cpu", "--adapter", str(adapter)])
    served, _ = prepare_model(args)
    assert {layer.weight_format for layer in quant_layers(served).values()} == {"bf16"}  # the unquantized path

    reference = copy.deepcopy(model).eval()
    modules = dict(reference.named_modules())
    for name, delta in deltas.items():  # that path stores its weights in bf16 (format "bf16")
        w = modules[name].weight
        w.data = w.data.to(torch.bfloat16).to(w.dtype) + delta
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        got, want = served(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_merge_a_mixture_of_experts_adapter_with_expert_lora(tmp_path):
    """Expert LoRA (PEFT target_parameters) merges too: the merged model's logits are PEFT's unmerged ones on the
    same 16-bit base."""
    from peft import PeftModel
    from tiny_moe import tiny_moe
    from transformers import AutoModelForCausalLM

    from qerl.models import lora_parameters

    dense = tiny_moe("qwen3_moe", experts_implementation="eager")
    dense.save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    q = quantize_model(copy.deepcopy(dense), "nvfp4", lora=LoraConfig(r=4, alpha=8.0, experts=True))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_parameters(q).values():  # every factor matters, the experts' included
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    save_adapter(q, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))

    assert main(["merge", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    peft_model = PeftModel.from_pretrained(copy.deepcopy(dense), tmp_path / "adapter").eval()
    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want, base = merged(ids).logits, peft_model(ids).logits, dense(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - base).abs().max() > 1e-3


def test_merge_refuses_an_adapter_that_does_not_fit_and_warns_on_another_base(trained, tmp_path, capsys):
    # a 1-layer base has half the modules: PEFT alone skipped the other half's tensors and exited 0
    base_dir, adapter, _, _ = trained
    small = tmp_path / "small"
    tiny_model("llama", num_hidden_layers=1).save_pretrained(small)
    tiny_tokenizer().save_pretrained(small)
    assert main(["merge", str(adapter), "--out", str(tmp_path / "o"), "--model", str(small)]) == 2
    err = capsys.readouterr().err
    assert "match no module of the model" in err and "layers.1." in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    # wider layers: one line naming a tensor and both shapes, not PEFT's dump of every mismatch
    wide = tmp_path / "wide"
    tiny_model("llama", intermediate_size=192).save_pretrained(wide)
    tiny_tokenizer().save_pretrained(wide)
    assert main(["merge", str(adapter), "--out", str(tmp_path / "o"), "--model", str(wide)]) == 2
    err = capsys.readouterr().err
    assert "another shape" in err and len(err.strip().splitlines()) <= 3
    # same shapes, other weights: merged, with eval's warning
    other = tmp_path / "other"
    tiny_model("llama", seed=1).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    assert main(["merge", str(adapter), "--out", str(tmp_path / "o"), "--model", str(other)]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "was trained on" in err


def test_merge_refuses_to_overwrite_its_own_input_and_a_non_finite_adapter(trained, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    base_dir, adapter, _, _ = trained
    before = (adapter / "adapter_model.safetensors").read_bytes()
    for out in (adapter, adapter.parent, adapter / "merged", base_dir):
        assert main(["merge", str(adapter), "--out", str(out), "--model", str(base_dir), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "the input" in err and "choose an output path apart from" in err, err
    assert (adapter / "adapter_model.safetensors").read_bytes() == before
    weights = load_file(adapter / "adapter_model.safetensors")
    weights[next(iter(weights))][0, 0] = float("nan")
    save_file(weights, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    assert main(["merge", str(adapter), "--out", str(tmp_path / "o"), "--model", str(base_dir)]) == 2
    assert "hold NaN or Inf" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
