"""AWQ: the scale search against a brute-force float64 reference, its gain over plain NVFP4 on outlier
activations, the folds keeping the dense model's function (with and without GQA, with biases), and
AQN on a folded model drawing the same policy as on the unfolded one."""

import copy

import pytest
import torch

from qerl.formats import get_format
from qerl.nn.noisy_norm import CHANNEL_SCALE, NoisyNorms, find_noisy_norms
from qerl.quant.awq import ACT_FLOOR, GROUPS, apply_awq, awq_search, channel_scales, fold, set_channel_scales

from tiny import tiny_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------ fake quantizers


def nvfp4_fake_quant(ws):
    """NVFP4 round-to-nearest with the siblings' shared (minimum) global scale, dequantized to fp32."""
    spec = get_format("nvfp4")
    gs = torch.stack([spec.global_scale(w) for w in ws]).amin(0)
    return [spec.dequantize(**spec.quantize(w, gs), dtype=torch.float32) for w in ws]


def rowwise_int3(ws):
    """Symmetric 3-bit per output row, absmax scale: coarse, so scaling matters a lot."""
    out = []
    for w in ws:
        step = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 3
        out.append(torch.round(w / step) * step)
    return out


# ------------------------------------------------------------------------------------------ reference


def ref_errors(ws, x, fake_quant, grid):
    """[(alpha, s float64 [K], error)] by the definition: ||x W^T - (x / s) Q(W s)^T||^2 summed, float64."""
    x = x.double()
    act = x.abs().mean(0)
    act = act.clamp(min=float(act.max()) * ACT_FLOOR) if act.max() > 0 else torch.ones_like(act)
    out = []
    for i in range(grid + 1):
        alpha = i / grid
        s = act ** alpha
        s = s / torch.sqrt(s.max() * s.min())
        qs = fake_quant([(w.double() * s).float() for w in ws])
        err = sum(float(((x @ w.double().t()) - (x / s) @ q.double().t()).pow(2).sum()) for w, q in zip(ws, qs))
        out.append((alpha, s, err))
    return out


def ref_best(ws, x, fake_quant, grid):
    errs = ref_errors(ws, x, fake_quant, grid)
    best = min(range(len(errs)), key=lambda i: (errs[i][2], i))
    return errs[best], errs[0][2]


def search_case(name, seed=0, n=256, k=64):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(24, k, generator=g), torch.randn(8, k, generator=g) * 0.1]
    x = torch.randn(n, k, generator=g) * torch.rand(k, generator=g).add(0.2)
    if name == "zero_weight":
        ws[1].zero_()
    elif name == "all_zero_weights":
        ws = [torch.zeros_like(w) for w in ws]
    elif name == "outlier_channels":
        x[:, [3, 40]] *= 1e3
    elif name == "zero_channel":
        x[:, 7] = 0.0
        x[:, 50] *= 30.0
    return ws, x


# ------------------------------------------------------------------------------------------- search


@pytest.mark.parametrize("case", ["plain", "zero_weight", "all_zero_weights", "outlier_channels", "zero_channel"])
@pytest.mark.parametrize("fake_quant", [rowwise_int3, nvfp4_fake_quant])
def test_search_matches_brute_force(case, fake_quant):
    ws, x = search_case(case)
    s, info = awq_search(ws, x, fake_quant, grid=10)
    (alpha, s_ref, err_ref), err0_ref = ref_best(ws, x, fake_quant, grid=10)
    assert s.dtype == torch.float32 and s.shape == (x.shape[1],)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert info["alpha"] == alpha
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=0)
    assert info["error"] == pytest.approx(err_ref, rel=1e-4, abs=1e-6)
    assert info["error_unscaled"] == pytest.approx(err0_ref, rel=1e-4, abs=1e-6)
    assert info["error"] <= info["error_unscaled"]
    if case == "all_zero_weights":
        assert alpha == 0 and torch.equal(s, torch.ones_like(s))
    if case in ("outlier_channels", "zero_channel"):
        assert alpha > 0 and info["error"] < 0.9 * info["error_unscaled"]


def test_search_subsamples_rows_and_ignores_non_finite_rows():
    ws, x = search_case("outlier_channels", n=9000)
    x[5, 0] = float("inf")
    s, info = awq_search(ws, x, rowwise_int3, grid=5)
    assert torch.isfinite(s).all() and info["alpha"] > 0 and info["error"] <= info["error_unscaled"]


def test_search_rejects_mismatched_widths():
    with pytest.raises(ValueError, match="input width"):
        awq_search([torch.randn(4, 32), torch.randn(4, 16)], torch.randn(8, 32), rowwise_int3)


def test_a_failing_scaled_candidate_is_skipped_but_a_failing_plain_quantization_raises():
    ws, x = search_case("outlier_channels")

    def only_unscaled(qs):
        if not torch.equal(qs[0], ws[0]):
            raise RuntimeError("cannot quantize this")
        return rowwise_int3(qs)

    with pytest.warns(UserWarning, match="cannot quantize this"):
        s, info = awq_search(ws, x, only_unscaled, grid=4)
    assert info["alpha"] == 0 and torch.equal(s, torch.ones_like(s))

    def never(qs):
        raise RuntimeError("no quantizer")

    with pytest.raises(RuntimeError, match="no quantizer"):
        awq_search(ws, x, never)


def test_awq_beats_plain_nvfp4_on_heavy_tailed_weights_with_outlier_channels():
    g = torch.Generator().manual_seed(1)
    k = 256
    t = torch.distributions.StudentT(3.0)
    torch.manual_seed(1)
    ws = [t.sample((128, k)) * 0.02, t.sample((64, k)) * 0.02]
    channel = torch.rand(k, generator=g).add(0.1)
    channel[torch.randperm(k, generator=g)[:6]] *= 40.0
    x_cal, x_test = (torch.randn(n, k, generator=g) * channel for n in (2048, 2048))
    s, info = awq_search(ws, x_cal, nvfp4_fake_quant)

    def err(s_):
        qs = nvfp4_fake_quant([w * s_ for w in ws])
        return sum(float((x_test.double() @ w.double().t() - (x_test / s_).double() @ q.double().t()).pow(2).sum())
                   for w, q in zip(ws, qs))

    plain, awq = err(torch.ones(k)), err(s)
    assert info["alpha"] > 0
    assert awq < 0.8 * plain, (awq, plain)  # held-out rows, not the ones searched


# -------------------------------------------------------------------------------------- whole layers


def outlier_model(arch="llama", dtype=torch.float64, seed=0, **overrides):
    """A tiny model with outlier input channels for every AWQ group (norms, v rows, up rows)."""
    model = tiny_model(arch, dtype=torch.float32, seed=seed, **overrides).to(dtype)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                w = torch.rand(norm.weight.shape, generator=g) + 0.5
                w[torch.randperm(w.numel(), generator=g)[:3]] *= 20.0
                norm.weight.copy_(w)
            for lin in (layer.self_attn.v_proj, layer.mlp.up_proj):
                rows = torch.randperm(lin.out_features, generator=g)[:3]
                lin.weight[rows] *= 20.0
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.up_proj):
                if lin.bias is not None:
                    lin.bias.copy_(torch.randn(lin.bias.shape, generator=g))
    return model


def token_ids(seed=0, shape=(3, 24), vocab=160):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def capture_inputs(model, ids):
    """[{leaf name: input rows [n, K]}] per decoder layer, from one forward of the model as it is."""
    per_layer = [{} for _ in model.model.layers]
    handles = []
    for i, layer in enumerate(model.model.layers):
        for name, mod in layer.named_modules():
            leaf = name.rpartition(".")[2]
            if leaf in LINEARS:
                def hook(_m, args, d=per_layer[i], leaf=leaf):
                    d[leaf] = args[0].reshape(-1, args[0].shape[-1]).detach().clone()
                handles.append(mod.register_forward_pre_hook(hook))
    model(ids)
    for h in handles:
        h.remove()
    return per_layer


@torch.no_grad()
def awq_model(model, ids, fake_quant=rowwise_int3):
    """A folded copy of `model` and the scales per layer (inputs captured from the dense model)."""
    folded = copy.deepcopy(model)
    inputs = capture_inputs(model, ids)
    scales = [apply_awq(layer, inputs[i], fake_quant, grid=10) for i, layer in enumerate(folded.model.layers)]
    return folded, scales


@pytest.mark.parametrize("arch,overrides,o_folded", [
    ("llama", {}, False),  # 4 query heads, 2 kv heads: v -> o skipped
    ("llama", {"num_key_value_heads": 4, "mlp_bias": True, "attention_bias": True}, True),
    ("qwen2", {"num_key_value_heads": 4}, True),  # q/k/v biases
    ("qwen3", {"num_key_value_heads": 4}, True),  # q_norm / k_norm inside attention
])
def test_folds_keep_the_dense_model_unchanged(arch, overrides, o_folded):
    model = outlier_model(arch, **overrides)
    ids = token_ids()
    with torch.no_grad():
        ref = model(ids).logits
    folded, scales = awq_model(model, ids)
    expected = {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"}
    expected |= {"self_attn.v_proj"} if o_folded else set()
    for layer_scales in scales:
        assert set(layer_scales) == expected
        assert all(torch.isfinite(s).all() and (s > 0).all() and s.dtype == torch.float32
                   for s in layer_scales.values())
        assert all(not torch.allclose(s, torch.ones_like(s)) for s in layer_scales.values())
    scaled = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.up_proj.bias", "mlp.down_proj.weight"}
    if o_folded:
        scaled |= {"self_attn.v_proj.bias", "self_attn.o_proj.weight"}
    for name, p in folded.named_parameters():
        if name.startswith("model.layers."):
            local = name.split(".", 3)[3]
            assert torch.equal(p, model.get_parameter(name)) != (local in scaled), name
    with torch.no_grad():
        out = folded(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert list(folded.state_dict()) == list(model.state_dict())  # the scale buffers are not persistent


def test_missing_inputs_skip_their_groups_and_a_failing_search_changes_nothing():
    model = outlier_model()
    ids = token_ids()
    inputs = capture_inputs(model, ids)[0]
    layer = model.model.layers[0]
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    scales = apply_awq(layer, {"k_proj": inputs["q_proj"]}, rowwise_int3, grid=10)  # any sibling's key works
    assert set(scales) == {"input_layernorm"}
    after = layer.state_dict()
    for key, v in before.items():
        touched = key.startswith(("input_layernorm.", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"))
        assert torch.equal(after[key], v) != touched, key

    layer = model.model.layers[1]
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    calls = []

    def fails_late(ws):  # the third group's plain quantization raises after two searches succeeded
        calls.append(len(ws))
        if len(calls) > 22:
            raise RuntimeError("quantizer broke")
        return rowwise_int3(ws)

    with pytest.raises(RuntimeError, match="quantizer broke"):
        apply_awq(layer, capture_inputs(model, ids)[1], fails_late, grid=10)
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in before.items())
    assert not hasattr(layer.input_layernorm, CHANNEL_SCALE)


def test_bf16_layer_is_searched_in_fp32_and_written_back_in_bf16():
    """The folded bf16 model stays as close to the float32 model as a few bf16 roundings allow: within 4x the
    distance of the unfolded bf16 model itself (the folded weights and norms are each rounded once more)."""
    ids = token_ids()
    with torch.no_grad():
        exact = outlier_model(dtype=torch.float32)(ids).logits
    model = outlier_model(dtype=torch.bfloat16)
    with torch.no_grad():
        bf16_noise = (model(ids).logits.float() - exact).abs().max()
    folded, scales = awq_model(model, ids, nvfp4_fake_quant)
    assert all(p.dtype == torch.bfloat16 for p in folded.parameters())
    norm = folded.model.layers[0].input_layernorm
    assert getattr(norm, CHANNEL_SCALE).dtype == torch.float32
    with torch.no_grad():
        out = folded(ids).logits.float()
    assert torch.isfinite(out).all() and (out - exact).abs().max() < 4 * bf16_noise


def fake_quantize_linears(model, fake_quant=nvfp4_fake_quant):
    """Replace every decoder linear's weight by its fake-quantized value (siblings quantized together)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for group in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
                mods = [m for n, m in layer.named_modules() if n.rpartition(".")[2] in group]
                for m, q in zip(mods, fake_quant([m.weight.float() for m in mods])):
                    m.weight.copy_(q)
    return model


def test_awq_plus_nvfp4_gives_a_model_closer_to_the_dense_one():
    model = outlier_model(dtype=torch.float32, hidden_size=128, intermediate_size=256)
    torch.manual_seed(2)
    with torch.no_grad():  # heavy-tailed weights
        t = torch.distributions.StudentT(3.0)
        for layer in model.model.layers:
            for n, m in layer.named_modules():
                if n.rpartition(".")[2] in LINEARS:
                    m.weight.mul_(t.sample(m.weight.shape).abs())
    cal, test = token_ids(0, (4, 32)), token_ids(1, (4, 32))
    with torch.no_grad():
        ref = model(test).logits
    plain = fake_quantize_linears(copy.deepcopy(model))
    folded, _ = awq_model(model, cal, nvfp4_fake_quant)
    awq = fake_quantize_linears(folded)
    with torch.no_grad():
        e_plain = (plain(test).logits - ref).pow(2).mean().item()
        e_awq = (awq(test).logits - ref).pow(2).mean().item()
    assert e_awq < 0.8 * e_plain, (e_awq, e_plain)


# ---------------------------------------------------------------------------------------------- AQN


def folded_pair(**overrides):
    """(an outlier model, token ids, its AWQ-folded copy): the AQN tests' two models of one policy."""
    model, ids = outlier_model(**overrides), token_ids()
    return model, ids, awq_model(model, ids)[0]


def test_aqn_on_a_folded_model_draws_the_unfolded_models_policy():
    model, ids, folded = folded_pair(num_key_value_heads=4)
    with torch.no_grad():
        clean = folded(ids).logits
        for sigma in (0.05, 0.2):
            with NoisyNorms(model, sigma, seed=7) as a, NoisyNorms(folded, sigma, seed=7) as b:
                ref, out = model(ids).logits, folded(ids).logits
                assert not torch.allclose(out, clean, atol=1e-3)  # the noise does something
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
                a.resample(), b.resample()
                torch.testing.assert_close(folded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
            # without the scale, the same draw would perturb the folded norms differently
            saved = [(n, getattr(n, CHANNEL_SCALE)) for n in find_noisy_norms(folded)]
            for n, _ in saved:
                delattr(n, CHANNEL_SCALE)
            with NoisyNorms(model, sigma, seed=7), NoisyNorms(folded, sigma, seed=7):
                assert not torch.allclose(folded(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)
            for n, s in saved:
                n.register_buffer(CHANNEL_SCALE, s, persistent=False)
        assert torch.equal(folded(ids).logits, clean)  # the folded weights came back bit for bit


def test_relative_aqn_on_a_folded_model_draws_the_unfolded_models_policy():
    model, ids, folded = folded_pair(num_key_value_heads=4)
    with torch.no_grad():
        clean = folded(ids).logits
        with NoisyNorms(model, 0.1, seed=3, relative=True), NoisyNorms(folded, 0.1, seed=3, relative=True):
            out = folded(ids).logits
            assert not torch.allclose(out, clean, atol=1e-3)
            torch.testing.assert_close(out, model(ids).logits, rtol=1e-5, atol=1e-5)
        with NoisyNorms(model, 0.1, seed=3, relative=True), NoisyNorms(folded, 0.1, seed=3):  # absolute: another policy
            assert not torch.allclose(folded(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)


def test_aqn_sigma_zero_on_a_folded_model_is_bit_identical():
    model, ids, folded = folded_pair(dtype=torch.float32)
    weights = [n.weight.detach().clone() for n in find_noisy_norms(folded)]
    with torch.no_grad():
        clean = folded(ids).logits
        with NoisyNorms(folded, 0.0, seed=1) as aqn:
            aqn.resample()
            assert torch.equal(folded(ids).logits, clean)
            assert all(torch.equal(n.weight, w) for n, w in zip(find_noisy_norms(folded), weights))


# -------------------------------------------------------------------------------------- persistence


def test_channel_scales_round_trip_through_a_fresh_model():
    model = outlier_model(num_key_value_heads=4)
    ids = token_ids()
    folded, layer_scales = awq_model(model, ids)
    scales = channel_scales(folded)
    assert set(scales) == {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm",
                                                                               "post_attention_layernorm")}
    for i, per_layer in enumerate(layer_scales):
        assert torch.equal(scales[f"model.layers.{i}.input_layernorm"], per_layer["input_layernorm"])
    fresh = outlier_model(num_key_value_heads=4, seed=5)
    fresh.load_state_dict(folded.state_dict())
    assert channel_scales(fresh) == {}
    keys = list(fresh.state_dict())
    set_channel_scales(fresh, scales)
    assert list(fresh.state_dict()) == keys  # export and checkpoint tensors unchanged
    restored = channel_scales(fresh)
    assert set(restored) == set(scales) and all(torch.equal(restored[k], v) for k, v in scales.items())
    with torch.no_grad(), NoisyNorms(folded, 0.1, seed=3), NoisyNorms(fresh, 0.1, seed=3):
        assert torch.equal(fresh(ids).logits, folded(ids).logits)


def test_set_channel_scales_rejects_bad_paths_and_shapes():
    model = tiny_model("llama")
    d = model.config.hidden_size
    with pytest.raises(ValueError, match="no such module"):
        set_channel_scales(model, {"model.layers.9.input_layernorm": torch.ones(d)})
    with pytest.raises(ValueError, match="no 1-D weight"):
        set_channel_scales(model, {"model.layers.0.self_attn.q_proj": torch.ones(d)})
    with pytest.raises(ValueError, match="no 1-D weight"):
        set_channel_scales(model, {"model.layers.0.self_attn": torch.ones(d)})
    with pytest.raises(ValueError, match="finite positive"):
        set_channel_scales(model, {"model.layers.0.input_layernorm": torch.ones(d + 1)})
    with pytest.raises(ValueError, match="finite positive"):
        set_channel_scales(model, {"model.layers.0.input_layernorm": torch.zeros(d)})
    assert channel_scales(model) == {}


def test_a_norm_folded_twice_carries_the_product():
    layer = tiny_model("llama").model.layers[0]
    d = layer.input_layernorm.weight.numel()
    consumers = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    s1, s2 = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    w0 = layer.input_layernorm.weight.detach().clone()
    fold(layer.input_layernorm, consumers, s1)
    fold(layer.input_layernorm, consumers, s2)
    torch.testing.assert_close(getattr(layer.input_layernorm, CHANNEL_SCALE), s1 * s2)
    torch.testing.assert_close(layer.input_layernorm.weight, w0 / (s1 * s2))


@pytest.mark.parametrize("arch,overrides", [("llama", {"num_key_value_heads": 4}),
                                            ("qwen2", {"num_key_value_heads": 4}), ("llama", {})])
def test_adapter_of_an_awq_base_is_written_for_the_unfolded_model(tmp_path, arch, overrides):
    """The adapter qerl writes for a model AWQ-folded in-process loads with real peft onto the unfolded
    (dequantized) base and gives the folded model's outputs; loading it back folds it again; a checkpoint
    (original_base=False) keeps the weights as trained."""
    from peft import PeftModel

    from qerl.models import load_adapter, lora_parameters, quant_layers, quantize_model, save_adapter
    from qerl.nn import LoraConfig
    from qerl.quant.awq import FOLDED_SCALES

    base = outlier_model(arch, dtype=torch.float32, **overrides)
    ids = token_ids(shape=(4, 32))
    lora = LoraConfig(r=4, alpha=8)
    folded = quantize_model(copy.deepcopy(base), "nvfp4", lora, method="awq", calibration=ids)
    scales = getattr(folded, FOLDED_SCALES)
    assert any(p.endswith("mlp.up_proj") for p in scales)  # a linear producer is folded too
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in lora_parameters(folded).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        ours = folded(ids).logits
    save_adapter(folded, tmp_path / "original")
    save_adapter(folded, tmp_path / "as_trained", original_base=False)

    # the unfolded base: the folded quantized weights, dequantized, with every fold undone
    dense = copy.deepcopy(base)
    with torch.no_grad():
        for name, layer in quant_layers(folded).items():
            dense.get_submodule(name).weight.copy_(layer.dequantized_weight())
            if layer.bias is not None:
                dense.get_submodule(name).bias.copy_(layer.bias)
        for name, module in folded.named_modules():
            if name.endswith("layernorm"):
                dense.get_submodule(name).weight.copy_(module.weight)
        for path, s in scales.items():
            producer = dense.get_submodule(path)
            prefix, consumers = next((path[: -len(p)], c) for p, c in GROUPS if path.endswith(p))
            fold(producer, [dense.get_submodule(prefix + c) for c in consumers], 1.0 / s)
    peft_model = PeftModel.from_pretrained(dense, tmp_path / "original").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    again = quantize_model(copy.deepcopy(base), "nvfp4", method="awq", calibration=ids)
    load_adapter(again, tmp_path / "original")
    for k, p in lora_parameters(again).items():
        torch.testing.assert_close(p, lora_parameters(folded)[k], rtol=1e-6, atol=0)
    from safetensors.torch import load_file

    raw = load_file(tmp_path / "as_trained" / "adapter_model.safetensors")
    assert all(torch.equal(raw["base_model.model." + k], p) for k, p in lora_parameters(folded).items())
    exported = load_file(tmp_path / "original" / "adapter_model.safetensors")
    assert any(not torch.equal(exported["base_model.model." + k], p) for k, p in lora_parameters(folded).items())


def test_the_median_norm_weight_of_a_folded_model_is_the_unfolded_models():
    # AQN's noise on a folded norm is drawn in the unfolded units, so the weak-noise check must read those
    from qerl.nn.noisy_norm import median_abs_norm_weight

    model = outlier_model(num_key_value_heads=4)
    folded, _ = awq_model(model, token_ids())
    raw = torch.cat([n.weight.detach().abs().flatten() for n in find_noisy_norms(folded)]).median().item()
    assert abs(raw - median_abs_norm_weight(model)) > 1e-3 * median_abs_norm_weight(model)  # folding moved them
    assert median_abs_norm_weight(folded) == pytest.approx(median_abs_norm_weight(model), rel=1e-6)


def test_folded_covariances_are_those_of_the_folded_layers_inputs():
    from qerl.models.calibration import capture_layer_inputs, layer_statistics
    from qerl.quant.awq import folded_covariances

    model = outlier_model("qwen2", num_key_value_heads=4)
    layer = model.model.layers[0]
    ids = token_ids(shape=(4, 32))
    batches = capture_layer_inputs(model, ids, "cpu")
    leaders = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]
    rows = ids.numel()
    before, samples = layer_statistics(layer, leaders, batches, rows)
    folds = apply_awq(layer, {n.rpartition(".")[2]: s for n, s in samples.items()}, nvfp4_fake_quant)
    assert {"input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"} <= set(folds)
    after, _ = layer_statistics(layer, leaders, batches, rows)
    predicted = folded_covariances(before, folds)
    for name in leaders:
        # fp32 sums of products (layer_statistics), folded or not: agreement to fp32 rounding
        torch.testing.assert_close(predicted[name], after[name], rtol=1e-4, atol=1e-6 * after[name].abs().max())
    assert not torch.allclose(before["mlp.down_proj"], after["mlp.down_proj"])
