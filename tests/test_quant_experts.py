"""4-bit MoE experts (`QuantExperts`, `quantize_experts`) against transformers' own experts on CPU, fp32."""

import copy
import re

import pytest
import torch
from torch import nn

from qerl.formats.fp4 import unpack_fp4
from qerl.models.experts import dequantize_experts_into, quantize_experts
from qerl.nn.quant_experts import QuantExperts
from qerl.nn.quant_linear import QuantLinear

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

FORMATS = ("nvfp4", "mxfp4", "nf4")
E, H, I = 8, 64, 64  # noqa: E741 -- H and I multiples of every block size (16, 32, 64) along K


def _config(**overrides):
    kw = dict(vocab_size=128, hidden_size=H, intermediate_size=128, moe_intermediate_size=I, num_experts=E,
              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              experts_implementation="eager")
    return Qwen3MoeConfig(**{**kw, **overrides})


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = _config()
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # larger than the init's std 0.02 so that routing and logits depend on the experts
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _hf_experts(quant: QuantExperts) -> Qwen3MoeExperts:
    ref = Qwen3MoeExperts(_config()).float()
    dequantize_experts_into(ref, quant)
    return ref


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_hf_on_dequantized_experts(fmt, ids):
    model = _model()
    original = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    replaced = quantize_experts(model, fmt)
    assert sorted(replaced) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert not any("experts" in n for n, _ in model.named_parameters())
    for name, quant in replaced.items():
        assert model.get_submodule(name) is quant and quant.weight_format == fmt
        dequantize_experts_into(reference.get_submodule(name), quant)
        # the quantization changed the experts, by a finite, small amount
        orig = original.get_submodule(name)
        for deq, w in ((quant.dequantized_gate_up(), orig.gate_up_proj), (quant.dequantized_down(), orig.down_proj)):
            assert deq.shape == w.shape and deq.dtype == torch.float32
            err = (deq - w).abs()
            assert torch.isfinite(deq).all() and err.max() > 0
            assert err.norm() / w.norm() < 0.2
    with torch.no_grad():
        got = model(ids).logits
        want = reference(ids).logits
        orig_logits = original(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, orig_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_expert_holds_what_a_quant_linear_would(fmt):
    experts = _model().model.layers[0].mlp.experts
    quant = QuantExperts.from_experts(experts, fmt)
    for e in (0, E - 1):
        for weight in ("gate_up_proj", "down_proj"):
            w = getattr(experts, weight)[e]
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            dense = QuantLinear.from_linear(lin, fmt).quantized_tensors()
            for name, t in dense.items():
                stacked = getattr(quant, f"{weight}_{name}")
                assert stacked.shape == (E, *t.shape) and stacked.dtype == t.dtype
                assert torch.equal(stacked[e].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else stacked[e],
                                   t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)


def test_nvfp4_experts_use_all_16_codes():
    quant = QuantExperts.from_experts(_model().model.layers[0].mlp.experts, "nvfp4")
    codes = torch.cat([unpack_fp4(quant.gate_up_proj_weight_packed).flatten(),
                       unpack_fp4(quant.down_proj_weight_packed).flatten()])
    assert torch.unique(codes).tolist() == list(range(16))
    assert quant.gate_up_proj_weight_global_scale.shape == (E, 1)
    assert len(torch.unique(quant.gate_up_proj_weight_global_scale)) > 1  # one per expert


@pytest.mark.parametrize("fmt", FORMATS)
def test_routing_corner_cases_match_hf_forward(fmt):
    quant = QuantExperts.from_experts(_model().model.layers[0].mlp.experts, fmt)
    ref = _hf_experts(quant)
    torch.manual_seed(3)
    t = 10
    x = torch.randn(t, H)
    weights = torch.rand(t, 2)
    cases = {
        # expert 3 takes every token (first slot), expert 5 the second slot of every token; the rest none
        "one expert takes all": torch.stack([torch.full((t,), 3), torch.full((t,), 5)], dim=1),
        # experts 0..6 only: expert 7 receives no token
        "idle expert": torch.randint(0, E - 1, (t, 2), generator=torch.Generator().manual_seed(4)),
        # the expert-parallel sentinel E is skipped by both
        "sentinel": torch.stack([torch.full((t,), E), torch.arange(t) % E], dim=1),
    }
    for case, idx in cases.items():
        with torch.no_grad():
            got, want = quant(x, idx, weights), ref(x, idx, weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=case)
    # single token, one slot on one expert
    idx = torch.tensor([[2]])
    with torch.no_grad():
        torch.testing.assert_close(quant(x[:1], idx, weights[:1, :1]), ref(x[:1], idx, weights[:1, :1]))


def test_gradient_reaches_input_not_experts():
    quant = QuantExperts.from_experts(_model().model.layers[0].mlp.experts, "nvfp4")
    assert list(quant.parameters()) == []
    x = torch.randn(6, H, requires_grad=True)
    w = torch.rand(6, 2, requires_grad=True)
    quant(x, torch.randint(0, E, (6, 2)), w).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert w.grad is not None


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_dtype_keeps_storage_dtypes(fmt):
    quant = QuantExperts.from_experts(_model().model.layers[0].mlp.experts, fmt)
    before = {n: (b.dtype, b.clone()) for n, b in quant.named_buffers()}
    quant.to(torch.bfloat16)
    quant.half()
    for n, b in quant.named_buffers():
        assert b.dtype == before[n][0], n
        assert torch.equal(b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
                           before[n][1].view(torch.uint8) if b.dtype == torch.float8_e4m3fn else before[n][1])
    # the bf16 forward equals HF's on bf16 dequantized weights
    ref = _hf_experts(quant).to(torch.bfloat16)
    x = torch.randn(5, H, dtype=torch.bfloat16)
    idx = torch.randint(0, E, (5, 2))
    w = torch.rand(5, 2, dtype=torch.bfloat16)
    with torch.no_grad():
        got = quant(x, idx, w)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, ref(x, idx, w), rtol=0, atol=0)


def test_qwen2_moe_same_layout(ids):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=128, hidden_size=H, intermediate_size=128, moe_intermediate_size=I,
                         shared_expert_intermediate_size=64, num_experts=E, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         experts_implementation="eager")
    model = Qwen2MoeForCausalLM(cfg).float().eval()
    reference = copy.deepcopy(model)
    replaced = quantize_experts(model, "nvfp4")
    assert len(replaced) == 2
    for name, quant in replaced.items():
        dequantize_experts_into(reference.get_submodule(name), quant)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


class GptOssLikeExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.zeros(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H))


def test_unsupported_layouts_are_refused_before_any_change():
    model = _model()
    model.model.layers[1].mlp.experts = GptOssLikeExperts()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts \(GptOssLikeExperts\).*not supported"):
        quantize_experts(model, "nvfp4")
    assert isinstance(model.model.layers[0].mlp.experts, Qwen3MoeExperts)  # nothing changed

    model = _model()
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts \(Qwen3MoeExperts\).*gate_up_proj_bias"):
        quantize_experts(model, "mxfp4")

    model = _model()
    model.model.layers[0].mlp.experts.is_transposed = True
    with pytest.raises(ValueError, match="is_transposed=True is not supported"):
        quantize_experts(model, "nf4")

    with pytest.raises(ValueError, match="unknown weight format"):
        quantize_experts(_model(), "int3")
    with pytest.raises(ValueError, match="4-bit format"):
        quantize_experts(_model(), "bf16")


def test_block_size_checked_before_any_change():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config(moe_intermediate_size=32))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts .*down_proj has 32 input features.*nf4 "
                                         r"block size 64"):
        quantize_experts(model, "nf4")
    assert all(isinstance(layer.mlp.experts, Qwen3MoeExperts) for layer in model.model.layers)
    assert len(quantize_experts(model, "mxfp4")) == 2  # 32 fills MXFP4's block


def test_dense_weights_are_freed():
    model = _model()
    old = model.model.layers[0].mlp.experts
    quantize_experts(model, "nvfp4")
    assert old.gate_up_proj is None and old.down_proj is None


# ---- quantize_model on MoE models (experts wired into the model path) ----

from qerl.models import lora_parameters, memory_report, quant_layers, quantize_model, save_quantized  # noqa: E402
from qerl.nn import LoraConfig  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _state(model):
    return {n: t.clone() for n, t in model.state_dict().items()}


def _assert_unchanged(model, before):
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    assert all(isinstance(layer.mlp.experts, Qwen3MoeExperts) for layer in model.model.layers)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_quantize_model_quantizes_linears_and_experts(ids):
    model = quantize_model(_model(), "nvfp4", lora=LoraConfig(r=4, alpha=8))
    layers = quant_layers(model)
    assert sorted({n.rpartition(".")[2] for n in layers}) == sorted(ATTENTION)  # MoE layers have no dense MLP
    assert all(m.weight_format == "nvfp4" and m.lora_A is not None for m in layers.values())
    for layer in model.model.layers:
        assert isinstance(layer.mlp.experts, QuantExperts) and layer.mlp.experts.weight_format == "nvfp4"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and trainable
    assert not model.model.layers[0].mlp.gate.weight.requires_grad  # the router is frozen
    assert model.config.qerl_weight_format == "nvfp4"
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_experts_false_leaves_experts_dense():
    model = quantize_model(_model(), "mxfp4", experts=False)
    assert quant_layers(model)
    for layer in model.model.layers:
        assert isinstance(layer.mlp.experts, Qwen3MoeExperts)
        assert not layer.mlp.experts.gate_up_proj.requires_grad
    assert memory_report(model)["quantized_params"] == sum(m.in_features * m.out_features
                                                           for m in quant_layers(model).values())


def test_4over6_quantizes_experts_with_the_scale_search():
    from qerl.quant import quantize_group

    model = _model()
    w = model.model.layers[1].mlp.experts.down_proj[3].detach().clone()
    quantize_model(model, "nvfp4", method="4over6")
    quant = model.model.layers[1].mlp.experts
    assert isinstance(quant, QuantExperts)
    want = quantize_group("nvfp4", "4over6", [w])[0]
    for name, t in want.items():
        got = getattr(quant, f"down_proj_{name}")[3]
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn \
            else torch.equal(got, t)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_refused_on_moe_before_any_change(method):
    model = _model()
    before = _state(model)
    with pytest.raises(ValueError, match="gptq/awq do not handle MoE experts yet; use rtn or 4over6, or "
                                         "experts=False"):
        quantize_model(model, "nvfp4", method=method, calibration=torch.zeros(1, 8, dtype=torch.long))
    _assert_unchanged(model, before)


def test_unsupported_experts_refused_before_dense_linears_change():
    model = _model()
    model.model.layers[1].mlp.experts.is_transposed = True
    before = _state(model)
    with pytest.raises(ValueError, match="is_transposed=True is not supported"):
        quantize_model(model, "nvfp4", lora=LoraConfig(r=4, alpha=8))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_keep_bf16_naming_experts_refused_other_patterns_ignore_them():
    model = _model()
    before = _state(model)
    for spec, hit in (("model.layers.1.mlp.experts", 1), ("model.layers.1.mlp", 1), ("*.experts", 0)):
        with pytest.raises(ValueError, match=rf"keep_bf16 entry '{re.escape(spec)}' matches the MoE experts "
                                             rf"module model\.layers\.{hit}\.mlp\.experts.*not supported"):
            quantize_model(model, "nvfp4", keep_bf16=[spec])
        _assert_unchanged(model, before)
    quantize_model(model, "nvfp4", keep_bf16=["*.o_proj", "last:1"])
    assert quant_layers(model)["model.layers.0.self_attn.o_proj"].weight_format == "bf16"
    assert quant_layers(model)["model.layers.1.self_attn.q_proj"].weight_format == "bf16"
    assert quant_layers(model)["model.layers.0.self_attn.q_proj"].weight_format == "nvfp4"
    assert all(isinstance(layer.mlp.experts, QuantExperts) for layer in model.model.layers)


@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_report_counts_experts_as_quantized_base(fmt):
    model = quantize_model(_model(), fmt, lora=LoraConfig(r=4, alpha=8))
    report = memory_report(model)
    linears = sum(m.in_features * m.out_features for m in quant_layers(model).values())
    n_layers = len(model.model.layers)
    assert report["quantized_params"] == linears + n_layers * E * (2 * I * H + H * I)
    experts = [layer.mlp.experts for layer in model.model.layers]
    experts_bytes = sum(b.numel() * b.element_size() for m in experts for b in m.buffers())
    linear_bytes = sum(b.numel() * b.element_size() for m in quant_layers(model).values() for b in m.buffers())
    assert report["quantized_bytes"] == experts_bytes + linear_bytes
    # 4-bit codes (0.5 byte) plus scales: a little over half a byte per weight
    assert 0.5 < report["base_bytes_per_param"] < 0.6
    assert report["kept_bf16_params"] == 0
    assert report["total_bytes"] == report["quantized_bytes"] + report["lora_bytes"] + report["other_bytes"]


def test_save_quantized_refuses_other_experts_layouts_before_writing(tmp_path):
    """Qwen experts are saved per expert (tests/test_moe_checkpoint.py); a QuantExperts subclass (another
    layout, e.g. gpt-oss's) has no per-expert form yet and is refused before anything is written."""
    class OtherLayout(QuantExperts):
        pass

    model = quantize_model(_model(), "nvfp4")
    model.model.layers[1].mlp.experts.__class__ = OtherLayout
    out = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts \\(OtherLayout\\).*per-expert checkpoint form"):
        save_quantized(model, None, out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def _log_probs(logits, ids):
    """log p(ids[:, t + 1] | ids[:, :t + 1]) [B, T - 1], in fp32."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_lora_gradients_equal_peft_on_the_dequantized_base(ids):
    """Issue #33's exactness target: qerl's quantized MoE model with LoRA gives the log-probs and the LoRA
    gradients of real peft's LoRA on a dense model holding the dequantized base (linears and experts)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from tiny_moe import fill_dense_twin

    model = _model()
    reference = copy.deepcopy(model)
    quantize_model(model, "nvfp4", lora=LoraConfig(r=4, alpha=8, dropout=0.0))
    with torch.no_grad():
        for p in lora_parameters(model).values():  # B is zero at init: make both factors matter
            p.normal_(0, 0.1)
    fill_dense_twin(reference, model)
    peft_model = get_peft_model(reference, PeftLoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                          target_modules=list(ATTENTION)))
    ours = lora_parameters(model)
    theirs = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    name_of = {n: n.replace("base_model.model.", "", 1).replace(".default.", ".") for n in theirs}
    assert sorted(name_of.values()) == sorted(ours)
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(ours[name_of[n]])
    model.eval()
    peft_model.eval()

    lp_ours, lp_theirs = _log_probs(model(ids).logits, ids), _log_probs(peft_model(ids).logits, ids)
    torch.testing.assert_close(lp_ours, lp_theirs, rtol=1e-5, atol=1e-5)
    lp_ours.sum().backward()
    lp_theirs.sum().backward()
    for n, p in theirs.items():
        g_ours, g_theirs = ours[name_of[n]].grad, p.grad
        assert g_ours is not None and g_theirs is not None and g_theirs.abs().sum() > 0, n
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-5 * g_theirs.abs().max().item(), msg=n)


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_forward_equals_the_reference_loop(fmt):
    """The grouped path's routing (pairs sorted by expert, offsets, the weights' product per row, index_add)
    with a plain-torch grouped product equals the eager loop: 64 tokens over 8 experts, one expert receiving
    nothing, and an expert-parallel sentinel pair (index E) skipped."""
    torch.manual_seed(3)
    quant = QuantExperts.from_experts(_model().model.layers[0].mlp.experts, fmt)
    T, k = 64, 2
    index = torch.randint(0, E - 1, (T, k))  # expert E - 1 receives nothing
    index[5, 1] = E  # a sentinel pair
    weights = torch.rand(T, k)
    hidden = torch.randn(T, H)

    def plain(x, offsets, weight):
        offsets = offsets.tolist()
        out = torch.zeros(x.shape[0], 2 * I if weight == "gate_up_proj" else H)  # rows no expert owns: 0
        for e in range(E):
            a, b = offsets[e], offsets[e + 1]
            out[a:b] = x[a:b] @ quant.dequantized_expert(weight, e, x.dtype).T
        return out

    got = quant.grouped_forward(hidden, index, weights, plain)
    want = quant.reference_forward(hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.abs().sum() > 0
    assert torch.equal(quant(hidden, index, weights), want)  # fp32 on the CPU: the reference path


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_grouped_kernel_path_on_cuda_matches_the_reference(fmt):
    """On CUDA in bf16 the forward and the input gradient take the grouped kernels (the default; the flag
    turns them off), close to the reference loop's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(4)
    quant = QuantExperts.from_experts(_model().model.layers[0].mlp.experts, fmt).cuda()
    probe = torch.zeros(1, H, device="cuda", dtype=torch.bfloat16)
    quant.grouped_kernel = False
    assert not quant._grouped_applies(probe) and not quant.capturable(torch.bfloat16, probe.device)
    quant.grouped_kernel = True
    assert quant._grouped_applies(probe) and quant.capturable(torch.bfloat16, probe.device)
    assert not quant.capturable(torch.float32, probe.device)  # fp32: the reference loop
    T, k = 200, 2
    index = torch.randint(0, E, (T, k), device="cuda")
    weights = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    assert quant._grouped_applies(hidden)
    with torch.no_grad():
        got = quant(hidden, index, weights)
    want = quant.reference_forward(hidden, index, weights)
    assert torch.isfinite(got).all()
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    hidden.requires_grad_(True)  # the backward through the grouped input-gradient kernel
    quant(hidden, index, weights).float().square().sum().backward()
    got_grad, hidden.grad = hidden.grad, None
    quant.reference_forward(hidden, index, weights).float().square().sum().backward()
    assert torch.isfinite(got_grad).all()
    assert ((got_grad.float() - hidden.grad.float()).norm() / hidden.grad.float().norm()) < 2e-2
