"""Quantized checkpoints: qerl round trip, and interoperability with compressed-tensors in both directions."""

import json

import pytest
import torch
from tiny import ARCHS, tiny_model, tiny_tokenizer

from qerl.models import load_causal_lm, quant_layers, quantize_model, save_quantized
from qerl.models import checkpoint as ckpt

IDS = torch.randint(3, 150, (2, 19), generator=torch.Generator().manual_seed(1))


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_exact(tmp_path, arch, fmt):
    model = quantize_model(tiny_model(arch, dtype=torch.bfloat16), fmt)
    save_quantized(model, tiny_tokenizer(), tmp_path / "q")
    loaded, tokenizer = load_causal_lm(tmp_path / "q")
    assert tokenizer is not None and tokenizer("ab").input_ids == [68, 69]
    assert set(quant_layers(loaded)) == set(quant_layers(model))
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        bits = want[k].view(-1).view(torch.uint8), got[k].view(-1).view(torch.uint8)
        assert want[k].dtype == got[k].dtype and torch.equal(*bits), k
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)
    assert all(not p.requires_grad for p in loaded.parameters())


def test_layout_on_disk(tmp_path):
    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16), "nvfp4")
    save_quantized(model, None, tmp_path / "q")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        p = "model.layers.0.self_attn.q_proj"
        assert f.get_tensor(f"{p}.weight_packed").dtype == torch.uint8
        assert f.get_tensor(f"{p}.weight_packed").shape == (64, 32)
        assert f.get_tensor(f"{p}.weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor(f"{p}.weight_scale").shape == (64, 4)
        assert f.get_tensor(f"{p}.weight_global_scale").shape == (1,)
        assert f.get_tensor(f"{p}.bias").dtype == torch.bfloat16  # Qwen2 q/k/v bias stays 16-bit
        # q/k/v share one global scale, gate/up another: serving engines fuse them
        gs = [f.get_tensor(f"model.layers.0.self_attn.{n}_proj.weight_global_scale") for n in "qkv"]
        assert gs[0] == gs[1] == gs[2]
        gu = [f.get_tensor(f"model.layers.0.mlp.{n}_proj.weight_global_scale") for n in ("gate", "up")]
        assert gu[0] == gu[1]
    assert not any(k.endswith(".weight") and "proj" in k for k in keys), "no dense copy of a quantized weight"
    assert "lm_head.weight" not in keys  # tied to the embeddings
    assert not any("lora" in k for k in keys)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert "qerl_weight_format" not in config


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_compressed_tensors_parses_and_decompresses_our_checkpoint(tmp_path, fmt):
    """transformers + compressed-tensors (the stack vLLM's loader mirrors) load qerl's directory."""
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt)
    save_quantized(model, None, tmp_path / "q")
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qcfg)
    assert parsed.format == ckpt.CT_FORMATS[fmt]
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path / "q", quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    )
    assert isinstance(theirs.model.layers[0].mlp.down_proj, torch.nn.Linear)
    torch.testing.assert_close(_logits(theirs), _logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("with_activation_scale", [False, True])
def test_loads_a_checkpoint_written_by_compressed_tensors(tmp_path, with_activation_scale):
    """A directory produced by compressed-tensors' own NVFP4 compressor (as llm-compressor writes them)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from safetensors.torch import save_file

    dense = tiny_model("llama", dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("NVFP4" if with_activation_scale else "NVFP4A16", ["Linear"])
    state = {}
    for name, mod in dense.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        w = mod.weight.detach()
        gs = generate_gparam(w.amin(), w.amax())
        blocks = w.reshape(w.shape[0], -1, 16)
        s, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
        out = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": s, "weight_global_scale": gs,
                                              "weight_zero_point": zp}, scheme)
        state.update({f"{name}.{k}": v for k, v in out.items()})
        if with_activation_scale:
            state[f"{name}.input_global_scale"] = torch.ones(1)
    for name, t in dense.state_dict().items():
        if not any(name.startswith(p) for p in {k.rsplit(".", 1)[0] + "." for k in state}):
            state[name] = t
    (tmp_path / "ct").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "ct" / "model.safetensors")
    scheme.format = "nvfp4-pack-quantized"
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="nvfp4-pack-quantized",
                            quantization_status="compressed", ignore=["lm_head"])
    config = dense.config.to_dict()
    config["quantization_config"] = qc.model_dump(mode="json")
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))

    loaded, _ = load_causal_lm(tmp_path / "ct")
    # What compressed-tensors itself decompresses must be exactly what qerl's layers compute with.
    for name, layer in quant_layers(loaded).items():
        prefix = name + "."
        mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and k[len(prefix):] in
                ("weight_packed", "weight_scale", "weight_global_scale")}
        ref = NVFP4PackedCompressor.decompress(mine, scheme)["weight"]  # bf16
        assert torch.equal(layer.dequantized_weight(ref.dtype), ref), name
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    if not with_activation_scale:  # W4A4 would also quantize activations in their forward
        theirs = AutoModelForCausalLM.from_pretrained(
            tmp_path / "ct", quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16)
        torch.testing.assert_close(_logits(loaded), _logits(theirs), rtol=0, atol=0)
    assert torch.isfinite(_logits(loaded)).all()


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4")

    def write_then_fail(state, directory):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "write_shards", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_quantized(model, None, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []


def test_sharded_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "MAX_SHARD_BYTES", 20_000)
    model = quantize_model(tiny_model("mistral", dtype=torch.bfloat16), "nvfp4")
    save_quantized(model, None, tmp_path / "q")
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded, _ = load_causal_lm(tmp_path / "q")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)


def test_transformers_with_bitsandbytes_loads_our_nf4_checkpoint(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")  # in the test extra; absent on some GPU images
    from transformers import AutoModelForCausalLM

    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nf4")
    save_quantized(model, None, tmp_path / "q")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    for name, layer in quant_layers(model).items():
        linear4bit = theirs.get_submodule(name)
        assert isinstance(linear4bit, bnb.nn.Linear4bit), name
        ref = bnb.functional.dequantize_4bit(linear4bit.weight.data, linear4bit.weight.quant_state)
        assert torch.equal(layer.dequantized_weight(ref.dtype), ref), name
    torch.testing.assert_close(_logits(theirs), _logits(model), rtol=0.02, atol=0.02)  # bf16 compute paths differ
