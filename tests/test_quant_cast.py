"""Casting a quantized model (.half(), .bfloat16(), .float(), .to(dtype)) never touches the 4-bit storage:
NVFP4's global scale of a small-amax weight exceeds fp16's range, and a cast used to make it inf."""

import pytest
import torch
from tiny import tiny_model

from qerl.formats import get_format
from qerl.models import quantize_model
from qerl.nn import QuantEmbedding, QuantLinear

CASTS = {"half": lambda m: m.half(), "bfloat16": lambda m: m.bfloat16(), "float": lambda m: m.float(),
         "to(fp16)": lambda m: m.to(torch.float16), "to(cpu, fp16)": lambda m: m.to("cpu", torch.float16)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _snapshot(module):
    return {n: (t.dtype, _bits(t).clone()) for n, t in module.quantized_tensors().items()}


def _assert_same(module, before):
    for name, (dtype, bits) in before.items():
        t = getattr(module, name)
        assert t.dtype == dtype, name
        assert torch.equal(_bits(t), bits), name


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("cast", list(CASTS))
def test_quant_linear_keeps_its_storage(fmt, cast):
    w = torch.randn(32, 64) * 1e-4  # NVFP4 global scale 448*6/amax ~ 1e7 > fp16 max
    layer = QuantLinear(64, 32, fmt, get_format(fmt).quantize(w, None))
    before = _snapshot(layer)
    CASTS[cast](layer)
    _assert_same(layer, before)
    x = torch.randn(3, 64)
    ref = x @ layer.dequantized_weight().t()
    out = layer(x.to(torch.float16 if "16" in cast or cast == "half" else torch.bfloat16 if cast == "bfloat16"
                     else torch.float32)).float()
    assert torch.isfinite(out).all() and out.abs().sum() > 0
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_quant_embedding_keeps_its_storage(fmt):
    emb = torch.nn.Embedding(16, 64)
    with torch.no_grad():
        emb.weight.mul_(1e-4)
    q = QuantEmbedding.from_embedding(emb, get_format(fmt))
    before = _snapshot(q)
    q.half()
    _assert_same(q, before)
    assert torch.isfinite(q(torch.arange(16)).float()).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_half_model_gives_finite_logits_close_to_the_fp32_model(fmt):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.mul_(1e-4)
    quantize_model(model, fmt)
    x = torch.randint(3, 160, (2, 12))
    ref = model(x).logits
    model.half()
    assert model.model.layers[0].self_attn.o_proj.weight_packed.dtype == torch.uint8
    out = model.float()(x).logits  # back to fp32 compute: only fp16 rounding of the dense tensors remains
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-2)


def test_bf16_format_follows_the_dtype_like_a_dense_layer():
    layer = QuantLinear(64, 32, "bf16", get_format("bf16").quantize(torch.randn(32, 64), None))
    layer.half()
    assert layer.weight.dtype == torch.float16
