"""Bad model sources: each gives one clear error naming the file and the problem, and writes nothing."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny import tiny_model

from qerl.models import ModelLoadError, load_causal_lm, quantize_model, save_quantized


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_causal_lm(str(tmp_path / "nope"))


def test_directory_that_is_neither_hf_nor_gguf(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a Hugging Face model directory"):
        load_causal_lm(tmp_path)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unknown architecture 'gpt2'"):
        load_causal_lm(tmp_path)


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="config.json: invalid JSON"):
        load_causal_lm(tmp_path)


def test_not_a_model_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ModelLoadError, match="must be a .gguf"):
        load_causal_lm(tmp_path / "weights.bin")


@pytest.mark.parametrize("cut", [10, 5000])
def test_truncated_safetensors(tmp_path, cut):
    save_quantized(quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4"), None, tmp_path / "q")
    f = tmp_path / "q" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:cut])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: corrupt or truncated"):
        load_causal_lm(tmp_path / "q")


def test_missing_tensor_in_quantized_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    save_quantized(quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4"), None, tmp_path / "q")
    f = tmp_path / "q" / "model.safetensors"
    state = load_file(f)
    del state["model.layers.1.post_attention_layernorm.weight"]
    del state["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(state, f)
    with pytest.raises(ModelLoadError, match="lacks"):
        load_causal_lm(tmp_path / "q")


def _write_gguf(path, rows: int = 8):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((rows, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("keep", [40, 0.75])  # cut in the header, cut in the tensor data
def test_truncated_gguf(tmp_path, keep):
    good = tmp_path / "m.gguf"
    _write_gguf(good, rows=64)
    data = good.read_bytes()
    good.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"m.gguf: not a readable GGUF file: truncated \(\d+ bytes"):
        load_causal_lm(good)


def test_garbage_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_causal_lm(tmp_path / "x.gguf")


def test_shape_not_divisible_by_block():
    model = tiny_model("llama", hidden_size=40, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"q_proj: 40 input features is not a multiple of the nvfp4 block size 16"):
        quantize_model(model, "nvfp4")


def test_non_finite_weight_names_the_module():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj: nvfp4: weight has 1 non-finite"):
        quantize_model(model, "nvfp4")


def test_unknown_targets_and_format():
    with pytest.raises(ValueError, match="none of the target modules"):
        quantize_model(tiny_model("llama"), "nvfp4", targets=["qkv"])
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        quantize_model(tiny_model("llama"), "int3")


def test_cli_bad_input_exits_cleanly_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "qerl.cli", "quantize", str(tmp_path / "missing"), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 2
    assert "no such file or directory" in result.stderr
    assert not out.exists()


def test_code_in_a_model_directory_never_runs_by_default(tmp_path):
    """A config that points at custom code (auto_map) must not import it unless trust_remote_code=True."""
    marker = tmp_path / "executed"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    model = tiny_model("llama", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    try:
        load_causal_lm(tmp_path)
    except Exception:
        pass  # whatever happens (no tokenizer here), the code must not have run
    assert not marker.exists()
