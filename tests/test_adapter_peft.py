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


def test_an_embedded_base_is_named_by_its_hub_id_and_qerl_keeps_its_own_name(tmp_path):
    """PEFT (and vLLM, the hub) resolve `base_model_name_or_path`; an embedded name means nothing to them, so the
    config names the upstream model and the weights' metadata keeps qerl's name, which qerl reads back."""
    from peft import PeftConfig
    from safetensors import safe_open

    from qerl.models.adapter import adapter_base_mismatch, trained_base
    from qerl.models.merge import adapter_base
    from qerl.models.registry import EMBEDDED, upstream_name

    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8))
    ids = _train_a_few_steps(model, steps=2)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path="smollm2-135m-instruct")
    assert PeftConfig.from_pretrained(tmp_path / "adapter").base_model_name_or_path == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata()["qerl_base_model"] == "smollm2-135m-instruct"
    assert trained_base(tmp_path / "adapter") == adapter_base(tmp_path / "adapter") == "smollm2-135m-instruct"
    assert adapter_base_mismatch(tmp_path / "adapter", "smollm2-135m-instruct") is None
    assert "smollm2-135m-instruct" in adapter_base_mismatch(tmp_path / "adapter", "qwen2.5-coder-1.5b-instruct")
    # every embedded model names a hub id of the form owner/name; other names pass through
    assert all(upstream_name(n).count("/") == 1 for n in EMBEDDED) and upstream_name("/some/dir") == "/some/dir"
    # the real peft still loads it onto the base it is given, with the same logits
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    base = dequantize_model(quantize_model(tiny_model("llama"), "nvfp4"))
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_an_adapter_from_another_tool_names_its_base_in_the_peft_config(tmp_path):
    from qerl.models.adapter import trained_base

    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8))
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    from safetensors.torch import load_file, save_file

    save_file(load_file(weights), weights, metadata={"format": "pt"})  # no qerl_base_model
    assert trained_base(tmp_path / "adapter") == "tiny"
