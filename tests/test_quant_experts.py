"""4-bit MoE experts (`QuantExperts`, `quantize_experts`) against transformers' own experts on CPU, fp32."""

import copy

import pytest
import torch
from torch import nn

from qerl.formats import get_format
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
