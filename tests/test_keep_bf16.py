"""Per-layer precision (`keep_bf16`): which targets stay 16-bit, what they cost, and that the kept layers
survive every path -- quantize_model, the streaming loader, qerl's checkpoints, transformers' loaders."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_model, tiny_tokenizer

from qerl.formats import FORMATS, get_format
from qerl.models import Quantization, load_causal_lm, memory_report, quant_layers, quantize_model, save_quantized
from qerl.models.checkpoint import KEEP_KEY
from qerl.models.targets import find_targets
from qerl.models.precision import (check_keep_bf16, describe_keep_bf16, keep_bf16_extra_bytes, match_keep_bf16,
                                   partial_sibling_groups, resolve_keep_bf16)
from qerl.models.stream import stream_quantized
from qerl.nn import DEFAULT_TARGETS, LoraConfig

IDS = torch.randint(3, 150, (2, 11), generator=torch.Generator().manual_seed(5))
LORA = LoraConfig(r=4, alpha=8)
# q_proj alone splits the q/k/v group of layer 0; whole groups elsewhere
MIXED = ["last:1", "model.layers.0.self_attn.q_proj", "*.down_proj"]


def _names(layer: int, *leaves: str) -> set[str]:
    where = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn"}
    return {f"model.layers.{layer}.{where.get(leaf, 'mlp')}.{leaf}_proj" for leaf in leaves}


ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                     b.view(-1).view(torch.uint8))


# ------------------------------------------------------------------------------------------- patterns


def test_patterns_names_modules_and_last_layers():
    model = tiny_model("llama", num_hidden_layers=4)
    assert resolve_keep_bf16(model, ["model.layers.0.self_attn.q_proj"]) == _names(0, "q")
    assert resolve_keep_bf16(model, ["*.down_proj"]) == set().union(*(_names(i, "down") for i in range(4)))
    assert resolve_keep_bf16(model, ["model.layers.2"]) == resolve_keep_bf16(model, ["model.layers.2.*"]) \
        == _names(2, *ALL)
    assert resolve_keep_bf16(model, ["last:2"]) == _names(2, *ALL) | _names(3, *ALL)
    assert resolve_keep_bf16(model, ["last:1", "model.layers.0.mlp.*"]) == _names(3, *ALL) | _names(0, "gate", "up",
                                                                                                       "down")
    # a block quantized alone: patterns see full names through the prefix
    block = model.model.layers[1]
    assert resolve_keep_bf16(block, ["*.self_attn.k_proj"], name_prefix="model.layers.1.") == _names(1, "k")


def test_star_crosses_dots_and_results_keep_model_order():
    names = [f"model.layers.{i}.mlp.up_proj" for i in range(12)]
    assert match_keep_bf16(names, ["model.layers.1*"]) == [names[1], names[10], names[11]]
    assert match_keep_bf16(names, ["last:3", "model.layers.0.*"]) == [names[0], names[9], names[10], names[11]]


@pytest.mark.parametrize("spec,message", [
    ("model.layers.7.mlp.up_proj", "'model.layers.7.mlp.up_proj' matches no quantization target"),
    ("lm_head", "model.layers.0.self_attn.q_proj"),  # the message lists valid names
    ("*.Q_PROJ", "matches no quantization target"),  # case-sensitive
    ("last:0", "N >= 1"),
    ("last:two", "N >= 1"),
    ("last:3", "only 2 decoder layers"),
    ("", "module names or patterns"),
])
def test_bad_entries_are_named(spec, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        resolve_keep_bf16(tiny_model("llama"), [spec])


def test_syntax_check_needs_no_model_and_last_needs_the_whole_model():
    assert check_keep_bf16("last:4") == ["last:4"]  # one string is one entry, not its characters
    with pytest.raises(ValueError, match="N >= 1"):
        check_keep_bf16(["*.down_proj", "last:-1"])
    with pytest.raises(ValueError, match="whole model"):
        resolve_keep_bf16(tiny_model("llama").model.layers[1], ["last:1"], name_prefix="model.layers.1.")


def test_a_pattern_error_changes_nothing():
    model = tiny_model("llama", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="matches no quantization target"):
        quantize_model(model, "nvfp4", keep_bf16=["*.up_proj", "model.layers.9.*"])
    assert not quant_layers(model)


def test_calibrated_method_keeps_the_named_layers_dense():
    model = tiny_model("llama")
    dense = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    quantize_model(model, "nvfp4", method="gptq", calibration=torch.randint(3, 160, (4, 16)),
                   keep_bf16=["*.down_proj"])
    kept = model.model.layers[1].mlp.down_proj
    assert kept.weight_format == "bf16" and torch.equal(kept.weight, dense.to(torch.bfloat16))
    assert model.model.layers[1].mlp.up_proj.weight_format == "nvfp4"


def test_partial_sibling_groups():
    names = find_targets(tiny_model("llama"), DEFAULT_TARGETS)
    kept = _names(0, "q") | _names(1, "gate", "up", "down", "o")  # layer 1's gate/up whole: not partial
    assert partial_sibling_groups(kept, names) == [[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]]
    assert partial_sibling_groups(kept | _names(0, "k", "v"), names) == []


# ------------------------------------------------------------------------------------------- cost


def test_memory_cost_matches_what_the_model_holds():
    kept = _names(0, "down") | _names(1, "q", "k", "v")
    # down [64, 128]: 16384 bytes in bf16, 64*128*4.5/8 + 4 in NVFP4; q [64, 64], k / v [32, 64] likewise
    want = sum(2 * n * k - (n * k * 9 // 16 + 4) for n, k in [(64, 128), (64, 64), (32, 64), (32, 64)])
    assert keep_bf16_extra_bytes(tiny_model("llama"), kept, FORMATS["nvfp4"]) == want
    line = describe_keep_bf16(tiny_model("llama"), kept, FORMATS["nvfp4"])
    assert line == f"keep_bf16: 4 linears, +{want / 2**20:.1f} MiB over nvfp4"
    one = describe_keep_bf16(tiny_model("llama"), _names(0, "q"), FORMATS["mxfp4"])
    assert one.startswith("keep_bf16: 1 linear, +")

    full = memory_report(quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4"))
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4", keep_bf16=sorted(kept))
    assert keep_bf16_extra_bytes(model, kept, FORMATS["nvfp4"]) == want  # QuantLinear works too
    report = memory_report(model)
    assert report["total_bytes"] - full["total_bytes"] == want
    assert report["kept_bf16_bytes"] == 2 * (64 * 128 + 64 * 64 + 2 * 32 * 64)
    assert report["kept_bf16_params"] == 64 * 128 + 64 * 64 + 2 * 32 * 64
    assert report["quantized_params"] == full["quantized_params"] - report["kept_bf16_params"]
    assert report["base_bytes_per_param"] == pytest.approx(full["base_bytes_per_param"], rel=0.01)  # still ~4.5 bits
    assert report["other_bytes"] == full["other_bytes"]


# ------------------------------------------------------------------------------------------- quantize_model


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_kept_layers_hold_the_dense_weights_and_the_rest_is_unchanged(fmt):
    dense = tiny_model("qwen2", dtype=torch.bfloat16)  # q/k/v biases
    weights = {n: (lin.weight.clone(), lin.bias) for n, lin in find_targets(dense, DEFAULT_TARGETS).items()}
    spec = ["*.down_proj", "model.layers.1.self_attn"]  # whole q/k/v group: neighbours' scales unchanged
    model = quantize_model(dense, fmt, LORA, keep_bf16=spec)
    plain = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16), fmt, LORA)
    kept = _names(0, "down") | _names(1, "down", "q", "k", "v", "o")
    layers = quant_layers(model)
    assert set(layers) == set(weights)  # every target is a QuantLinear, kept or not
    for name, layer in layers.items():
        assert layer.lora_A is not None and layer.lora_A.weight.requires_grad, name
        if name in kept:
            w, b = weights[name]
            assert layer.weight_format == "bf16" and _same_bits(layer.weight, w), name
            assert (b is None and layer.bias is None) or _same_bits(layer.bias, b.detach()), name
        else:
            ref = quant_layers(plain)[name]
            assert layer.weight_format == fmt and layer._tensor_names == ref._tensor_names, name
            for t in ref._tensor_names:
                assert _same_bits(getattr(layer, t), getattr(ref, t)), f"{name}.{t}"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert len(trainable) == 2 * len(layers)
    assert torch.isfinite(_logits(model)).all()


def test_partial_groups_share_one_scale_among_the_quantized_siblings():
    dense = tiny_model("llama", dtype=torch.bfloat16)
    with torch.no_grad():  # q's amax is the largest: it would set q/k/v's shared (smallest) global scale
        dense.model.layers[0].self_attn.q_proj.weight.mul_(8)
    own = {n: get_format("nvfp4").global_scale(lin.weight) for n, lin in find_targets(dense, DEFAULT_TARGETS).items()}
    plain = quantize_model(copy.deepcopy(dense), "nvfp4").model.layers[0].self_attn
    assert torch.equal(plain.k_proj.weight_global_scale, own["model.layers.0.self_attn.q_proj"])  # q's, unkept
    model = quantize_model(dense, "nvfp4", keep_bf16=["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"])
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
    k, v = (own[f"model.layers.0.self_attn.{p}_proj"] for p in "kv")
    assert attn.q_proj.weight_format == "bf16"
    assert torch.equal(attn.k_proj.weight_global_scale, attn.v_proj.weight_global_scale)
    assert torch.equal(attn.k_proj.weight_global_scale, torch.minimum(k, v))
    assert not torch.equal(attn.k_proj.weight_global_scale, own["model.layers.0.self_attn.q_proj"])
    assert torch.equal(mlp.gate_proj.weight_global_scale, own["model.layers.1.mlp.gate_proj"])  # alone now
    # the serving-side view: the two quantized siblings still fuse into one weight
    from qerl.models.siblings import fuse_sibling_storage

    assert fuse_sibling_storage((attn.k_proj, attn.v_proj))


def test_keep_everything_leaves_a_bf16_base_with_lora():
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4", LORA, keep_bf16=["model.layers.*"])
    assert {m.weight_format for m in quant_layers(model).values()} == {"bf16"}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora_" in n}


def test_4over6_skips_the_kept_layers():
    dense = tiny_model("llama", dtype=torch.bfloat16)
    w = dense.model.layers[0].self_attn.k_proj.weight.clone()
    model = quantize_model(dense, "nvfp4", method="4over6", keep_bf16=["model.layers.0.self_attn.k_proj"])
    assert _same_bits(model.model.layers[0].self_attn.k_proj.weight, w)
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.q_proj.weight_global_scale, attn.v_proj.weight_global_scale)


# ------------------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("arch,fmt,method", [("llama", "nvfp4", "rtn"), ("qwen2", "nf4", "rtn"),
                                             ("mistral", "nvfp4", "4over6")])
def test_streamed_equals_load_then_quantize(tmp_path, arch, fmt, method):
    tiny_model(arch, dtype=torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    tiny_tokenizer().save_pretrained(tmp_path)
    expected, _ = load_causal_lm(tmp_path)
    quantize_model(expected, fmt, LORA, method=method, keep_bf16=MIXED)
    got, _ = stream_quantized(tmp_path, Quantization.of(fmt, method, lora=LORA, keep_bf16=MIXED))
    kinds = {n: m.weight_format for n, m in quant_layers(got).items()}
    assert kinds == {n: m.weight_format for n, m in quant_layers(expected).items()}
    assert {n for n, f in kinds.items() if f == "bf16"} == resolve_keep_bf16(tiny_model(arch), MIXED) \
        == _names(0, "q", "down") | _names(1, *ALL)
    a, b = expected.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        if ".lora_" not in key:
            assert _same_bits(a[key], b[key]), key
    assert {n for n, p in got.named_parameters() if p.requires_grad} == \
        {n for n, p in expected.named_parameters() if p.requires_grad}
    with torch.no_grad():  # same adapters -> same logits
        for name, p in got.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        expected.load_state_dict({k: v for k, v in got.state_dict().items() if ".lora_" in k}, strict=False)
    torch.testing.assert_close(_logits(got), _logits(expected), rtol=0, atol=0)


def test_streaming_checks_patterns_before_reading_weights(tmp_path):
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'model.layers.5.\\*' matches no quantization target"):
        stream_quantized(tmp_path, Quantization.of("nvfp4", keep_bf16=["model.layers.5.*"]))


# ------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_load_round_trip(tmp_path, arch, fmt):
    model = quantize_model(tiny_model(arch, dtype=torch.bfloat16), fmt, keep_bf16=MIXED)
    with pytest.warns(UserWarning, match="vLLM refuses"):  # q alone splits layer 0's q/k/v
        save_quantized(model, tiny_tokenizer(), tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    kept = sorted(n for n, m in quant_layers(model).items() if m.weight_format == "bf16")
    assert config[KEEP_KEY] == kept
    ignore = config["quantization_config"]["ignore" if fmt != "nf4" else "llm_int8_skip_modules"]
    assert set(ignore) == set(kept) | {"lm_head"}
    on_disk = load_file(tmp_path / "q" / "model.safetensors")
    for name in kept:  # a plain dense weight, nothing quantized
        assert _same_bits(on_disk[f"{name}.weight"], model.get_submodule(name).weight), name
        assert not any(k.startswith(f"{name}.weight_") or k.startswith(f"{name}.weight.") for k in on_disk), name

    loaded, _ = load_causal_lm(tmp_path / "q")
    assert not hasattr(loaded.config, KEEP_KEY)
    assert {n: (type(m), getattr(m, "weight_format", None)) for n, m in loaded.named_modules()} == \
        {n: (type(m), getattr(m, "weight_format", None)) for n, m in model.named_modules()}
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert _same_bits(want[k], got[k]), k
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)


def test_ignored_non_targets_stay_plain_linears(tmp_path):
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4", LORA,
                           targets=["q_proj", "k_proj", "v_proj"], keep_bf16=["model.layers.1.self_attn.*"])
    save_quantized(model, None, tmp_path / "q")
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.self_attn.o_proj" in ignore and "model.layers.1.self_attn.k_proj" in ignore
    assert not any(".lora_" in n for n in ignore)  # LoRA's own linears are no module of the checkpoint
    loaded, _ = load_causal_lm(tmp_path / "q")
    assert type(loaded.model.layers[1].self_attn.o_proj) is torch.nn.Linear
    assert loaded.model.layers[1].self_attn.k_proj.weight_format == "bf16"
    assert loaded.model.layers[0].self_attn.k_proj.weight_format == "nvfp4"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compressed_tensors_loads_the_kept_layers_as_dense_linears(tmp_path, fmt):
    """transformers + compressed-tensors (the stack vLLM's loader mirrors) load the directory; the kept
    layers are its ordinary nn.Linear with exactly our weights."""
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    spec = ["last:1", "model.layers.0.mlp.down_proj"]  # whole groups only: a directory vLLM accepts too
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt, keep_bf16=spec)
    save_quantized(model, None, tmp_path / "q")
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qcfg)
    # vLLM reads the ignore list; transformers' dequantizing loader also copes without it
    assert resolve_keep_bf16(tiny_model("llama"), spec) <= set(qcfg["ignore"])
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path / "q", quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16)
    for name in resolve_keep_bf16(tiny_model("llama"), spec):
        mine, their = model.get_submodule(name), theirs.get_submodule(name)
        assert type(their) is torch.nn.Linear and _same_bits(their.weight.data, mine.weight), name
    torch.testing.assert_close(_logits(theirs), _logits(model), rtol=0, atol=0)


def test_transformers_with_bitsandbytes_skips_the_kept_layers(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nf4", keep_bf16=["last:1"])
    save_quantized(model, None, tmp_path / "q")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    for name, layer in quant_layers(model).items():
        their = theirs.get_submodule(name)
        if layer.weight_format == "bf16":
            assert type(their) is torch.nn.Linear and _same_bits(their.weight.data, layer.weight), name
        else:
            assert isinstance(their, bnb.nn.Linear4bit), name
