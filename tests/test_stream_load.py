"""Loading a safetensors checkpoint straight into a quantized model, one layer at a time, gives exactly
what load_causal_lm + quantize_model give (tied and untied embeddings, biases, sharded files)."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_model, tiny_tokenizer

from qerl.models import ModelLoadError, Quantization, load_causal_lm, quantize_model
from qerl.models.stream import stream_quantized
from qerl.nn import LoraConfig


def _base_state(model):
    return {k: v for k, v in model.state_dict().items() if ".lora_" not in k}


@pytest.mark.parametrize("arch,fmt", [("llama", "nvfp4"), ("qwen2", "nvfp4"), ("qwen3", "nf4"), ("mistral", "mxfp4"),
                                      ("qwen2", "bf16")])
def test_streamed_equals_load_then_quantize(tmp_path, arch, fmt):
    tied = arch in ("qwen2", "qwen3")
    tiny_model(arch, dtype=torch.bfloat16, tie_word_embeddings=tied, hidden_size=64).save_pretrained(
        tmp_path, max_shard_size="40KB")  # several shards
    tiny_tokenizer().save_pretrained(tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    lora = LoraConfig(r=4, alpha=8)
    torch.manual_seed(3)
    expected, _ = load_causal_lm(tmp_path)
    quantize_model(expected, fmt, lora)
    torch.manual_seed(3)
    got, tok = stream_quantized(tmp_path, Quantization.of(fmt, lora=lora))
    assert tok is not None and got.config.qerl_weight_format == fmt
    a, b = _base_state(expected), _base_state(got)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert {n for n, p in got.named_parameters() if p.requires_grad} == \
        {n for n, p in expected.named_parameters() if p.requires_grad}
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == tied
    ids = torch.randint(3, 150, (2, 9))
    with torch.no_grad():
        for m in (got, expected):  # same adapter weights, so the logits must match too
            for name, p in m.named_parameters():
                if ".lora_B" in name:
                    p.copy_(torch.full_like(p, 0.01))
        got_a = {k: v for k, v in got.state_dict().items() if ".lora_A" in k}
        expected.load_state_dict(got_a, strict=False)
        torch.testing.assert_close(got(ids).logits, expected(ids).logits, rtol=0, atol=0)


def test_missing_or_extra_tensors_are_named(tmp_path):
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        stream_quantized(tmp_path, Quantization.of("nvfp4"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64, dtype=torch.bfloat16)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="no place for, e.g. \\['model.layers.9.mlp.up_proj.weight'\\]"):
        stream_quantized(tmp_path, Quantization.of("nvfp4"))


def test_cli_quantize_no_check_streams_the_same_directory(tmp_path):
    """`qerl quantize --no-check` (streamed, layer by layer) writes the same tensors as the checked path."""
    from qerl.cli import main

    src = tmp_path / "src"
    tiny_model("qwen2", dtype=torch.bfloat16).save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    outs = {}
    for flag in ([], ["--no-check"]):
        out = tmp_path / ("streamed" if flag else "checked")
        assert main(["quantize", str(src), "--format", "nvfp4", "--out", str(out), *flag]) == 0
        outs[bool(flag)] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert outs[True].keys() == outs[False].keys()
    for k in outs[True]:
        assert torch.equal(outs[True][k], outs[False][k]), k


def test_hub_id_streams_from_its_snapshot(tmp_path, monkeypatch):
    """A hub id is fetched as a safetensors snapshot (only the files streaming needs) and then streamed;
    when the snapshot cannot be fetched (offline) the caller falls back to load_causal_lm's path."""
    import huggingface_hub

    from qerl.models import pretrained

    snap = tmp_path / "snapshot"
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(snap)
    tiny_tokenizer().save_pretrained(snap)
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None):  # the network is not reachable from CI
        calls.append((repo_id, allow_patterns))
        if repo_id != "org/tiny":
            raise OSError("offline")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert pretrained.plain_hf_directory("org/tiny") == snap
    assert calls == [("org/tiny", list(pretrained.HUB_PATTERNS))]
    assert pretrained.plain_hf_directory("org/unreachable") is None
    assert pretrained.plain_hf_directory(str(tmp_path / "no-such-dir")) is None  # a path, never sent to the hub
    assert len(calls) == 2
