"""A qerl adapter trained a few steps loads with the real `peft` onto the dequantized base and gives
the same logits as qerl; a wrong adapter is refused with a message naming what differs."""

import json

import pytest
import torch
from peft import PeftModel
from tiny import tiny_model

from qerl.models import (AdapterError, dequantize_model, load_adapter, lora_parameters, quantize_model,
                         save_adapter)
from qerl.nn import LoraConfig


def _train_a_few_steps(model, steps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 150, (4, 24), generator=g)
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return ids


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_peft_loads_qerl_adapter_with_matching_logits(tmp_path, fmt, arch):
    model = quantize_model(tiny_model(arch), fmt, LoraConfig(r=4, alpha=8, dropout=0.1, use_rslora=arch == "qwen2"))
    ids = _train_a_few_steps(model)
    assert all(p.abs().sum() > 0 for n, p in lora_parameters(model).items() if "lora_B" in n), "training moved B"
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny")
    with torch.no_grad():
        ours = model(input_ids=ids).logits

    base = dequantize_model(quantize_model(tiny_model(arch), fmt))  # same seed -> same base weights
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not torch.isnan(ours).any()


def test_adapter_round_trip_through_qerl(tmp_path):
    model = quantize_model(tiny_model("qwen3"), "nvfp4", LoraConfig(r=8, alpha=16))
    ids = _train_a_few_steps(model)
    save_adapter(model, tmp_path / "a")
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    fresh = quantize_model(tiny_model("qwen3"), "nvfp4")
    cfg = load_adapter(fresh, tmp_path / "a")
    assert (cfg.r, cfg.alpha) == (8, 16)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, ours, rtol=0, atol=0)


def test_adapter_for_a_different_base_is_refused(tmp_path):
    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8))
    save_adapter(model, tmp_path / "a")
    wider = quantize_model(tiny_model("llama", hidden_size=96, intermediate_size=160), "nvfp4")
    with pytest.raises(AdapterError, match="shape"):
        load_adapter(wider, tmp_path / "a")
    deeper = quantize_model(tiny_model("llama", num_hidden_layers=3), "nvfp4")
    with pytest.raises(AdapterError, match="missing"):
        load_adapter(deeper, tmp_path / "a")


def test_bad_adapter_directories(tmp_path):
    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8))
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load_adapter(model, tmp_path)
    save_adapter(model, tmp_path / "a")
    weights = tmp_path / "a" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterError, match="corrupt or truncated"):
        load_adapter(model, tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="invalid JSON"):
        load_adapter(model, tmp_path / "a")


def test_save_adapter_refuses_to_clobber(tmp_path):
    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8))
    save_adapter(model, tmp_path / "a")
    before = (tmp_path / "a" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        save_adapter(model, tmp_path / "a")
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == before
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["peft_type"] == "LORA"
