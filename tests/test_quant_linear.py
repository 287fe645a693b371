"""QuantLinear (nn/quant_linear.py) for every registered weight format: forward, autograd, LoRA options."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qerl.formats import FORMATS, get_format
from qerl.nn import LoraConfig, QuantLinear

FMTS = sorted(FORMATS)
IN, OUT, R = 64, 48, 8


def make_layer(fmt, lora=LoraConfig(r=R, alpha=16.0), bias=True, seed=None):
    gen = torch.Generator().manual_seed(torch.seed() if seed is None else seed)
    linear = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(OUT, IN, generator=gen) * 0.1)
        if bias:
            linear.bias.copy_(torch.randn(OUT, generator=gen))
    layer = QuantLinear.from_linear(linear, fmt, lora)
    if layer.lora_B is not None:
        with torch.no_grad():  # a trained adapter: B != 0 so the delta is visible
            layer.lora_B.weight.copy_(torch.randn(OUT, lora.r, generator=gen) * 0.1)
    return layer, gen


def reference(layer, x, lora=True):
    """Same math from the parts: F.linear with the dequantized base + scaling * B(A(x)), in x.dtype."""
    y = F.linear(x, layer.dequantized_weight(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))
    if lora:
        h = F.linear(x, layer.lora_A.weight.to(x.dtype))
        y = y + F.linear(h, layer.lora_B.weight.to(x.dtype)) * layer.scaling
    return y


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_dequantized_linear_plus_lora(fmt, dtype):
    """The base alone is bit for bit F.linear with the dequantized weight. With LoRA the term scaling * B(A x)
    is added by the base matmul's epilogue (one addmm): within one rounding of the output dtype of the
    float64 sum of the same parts (A x rounded to the dtype first, as the layer computes it)."""
    layer, gen = make_layer(fmt)
    x = torch.randn(3, 5, IN, generator=gen).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 5, OUT)
    h = F.linear(x, layer.lora_A.weight.to(dtype))
    b = (layer.lora_B.weight.float() * layer.scaling).to(dtype)
    base = reference(layer, x, lora=False)
    want = base.double() + h.double() @ b.double().t()
    scale = base.double().abs() + h.double().abs() @ b.double().abs().t()
    eps = torch.finfo(dtype).eps
    assert ((y.double() - want).abs() <= eps * scale + 1e-6).all()
    assert not torch.equal(y, base)  # the adapter term is there
    layer.lora_enabled = False
    assert torch.equal(layer(x), reference(layer, x, lora=False))


@pytest.mark.parametrize("fmt", FMTS)
def test_gradients_match_float64_reference(fmt):
    layer, gen = make_layer(fmt)
    x = torch.randn(4, IN, generator=gen, requires_grad=True)
    g = torch.randn(4, OUT, generator=gen)
    (layer(x) * g).sum().backward()

    x64 = x.detach().double().requires_grad_()
    a64 = layer.lora_A.weight.detach().double().requires_grad_()
    b64 = layer.lora_B.weight.detach().double().requires_grad_()
    w64 = layer.dequantized_weight(torch.float64)
    y64 = x64 @ w64.T + layer.bias.double() + (x64 @ a64.T) @ b64.T * layer.scaling
    (y64 * g.double()).sum().backward()
    for got, want in ((x.grad, x64.grad), (layer.lora_A.weight.grad, a64.grad), (layer.lora_B.weight.grad, b64.grad)):
        assert got is not None and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert layer.lora_A.weight.grad.abs().sum() > 0  # B != 0, so A gets a real gradient


@pytest.mark.parametrize("fmt", FMTS)
def test_base_is_frozen_buffers(fmt):
    layer, gen = make_layer(fmt)
    names = set(get_format(fmt).tensor_names)
    assert {n for n, _ in layer.named_parameters()} == {"lora_A.weight", "lora_B.weight"}
    assert names | {"bias"} == {n for n, _ in layer.named_buffers()}
    assert names <= set(layer.state_dict())
    x = torch.randn(2, IN, generator=gen, requires_grad=True)
    layer(x).sum().backward()
    for name in names | {"bias"}:
        buf = getattr(layer, name)
        assert not buf.requires_grad and buf.grad is None


@pytest.mark.parametrize("fmt", FMTS)
def test_b_initialised_to_zero_gives_base_output(fmt):
    gen = torch.Generator().manual_seed(torch.seed())
    linear = nn.Linear(IN, OUT)
    layer = QuantLinear.from_linear(linear, fmt, LoraConfig(r=R, alpha=16.0))
    assert (layer.lora_B.weight == 0).all() and (layer.lora_A.weight != 0).any()
    x = torch.randn(3, IN, generator=gen)
    y = layer(x)
    layer.lora_enabled = False
    assert torch.equal(y, layer(x))
    assert torch.equal(y, F.linear(x, layer.dequantized_weight(), linear.bias.detach()))


def test_rslora_scaling():
    plain, gen = make_layer("nvfp4", LoraConfig(r=16, alpha=32.0), seed=1)
    rs, _ = make_layer("nvfp4", LoraConfig(r=16, alpha=32.0, use_rslora=True), seed=1)
    assert plain.scaling == 2.0 and rs.scaling == 32.0 / math.sqrt(16) == 8.0
    with torch.no_grad():
        rs.lora_A.weight.copy_(plain.lora_A.weight)
        rs.lora_B.weight.copy_(torch.randn(OUT, 16, generator=gen))
        plain.lora_B.weight.copy_(rs.lora_B.weight)
    x = torch.randn(4, IN, generator=gen)
    base = reference(plain, x, lora=False)
    torch.testing.assert_close(rs(x) - base, 4.0 * (plain(x) - base), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FMTS)
def test_dropout_only_in_train_mode(fmt):
    layer, gen = make_layer(fmt, LoraConfig(r=R, alpha=16.0, dropout=0.5))
    x = torch.randn(8, IN, generator=gen)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    assert torch.equal(layer(x), reference(layer, x))  # eval: dropout is the identity
    layer.train()
    torch.manual_seed(0)
    y1 = layer(x)
    y2 = layer(x)
    assert not torch.equal(y1, y2) and not torch.equal(y1, reference(layer, x))
    layer.lora_enabled = False  # dropout touches only the adapter input, never the base path
    assert torch.equal(layer(x), reference(layer, x, lora=False))


def test_from_linear_with_shared_global_scale():
    gen = torch.Generator().manual_seed(torch.seed())
    q, k = nn.Linear(IN, OUT, bias=False), nn.Linear(IN, OUT, bias=False)
    with torch.no_grad():
        q.weight.copy_(torch.randn(OUT, IN, generator=gen))
        k.weight.copy_(3 * torch.randn(OUT, IN, generator=gen))
    fmt = get_format("nvfp4")
    shared = torch.minimum(fmt.global_scale(q.weight), fmt.global_scale(k.weight))
    assert shared < fmt.global_scale(q.weight)
    lq = QuantLinear.from_linear(q, "nvfp4", LoraConfig(r=R), global_scale=shared)
    lk = QuantLinear.from_linear(k, "nvfp4", LoraConfig(r=R), global_scale=shared)
    assert torch.equal(lq.weight_global_scale, lk.weight_global_scale)
    assert torch.equal(lq.weight_global_scale, shared)
    expect = fmt.quantize(q.weight.detach(), shared)
    for name, t in expect.items():
        assert torch.equal(getattr(lq, name).view(torch.uint8), t.view(torch.uint8))
    x = torch.randn(2, IN, generator=gen)
    assert torch.equal(lq(x), F.linear(x, fmt.dequantize(**expect)))  # B = 0: the base alone
    assert (lq.dequantized_weight() - q.weight).norm() / q.weight.norm() < 0.15  # a coarser, still 4-bit grid
    for other in ("mxfp4", "nf4"):  # formats with no global scale refuse one
        with pytest.raises(ValueError, match="no global scale"):
            QuantLinear.from_linear(q, other, global_scale=shared)


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4", "bf16"])
def test_quantized_linear_adds_a_lora_delta(fmt):
    """quantized_linear(..., lora=(h, b)) == base + h @ b^T (the engine's path for adapters)."""
    from qerl.formats import get_format
    from qerl.kernels import quantized_linear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g)
    tensors = get_format(fmt).quantize(w)
    x = torch.randn(2, 3, 64, generator=g)
    bias = torch.randn(48, generator=g)
    h, b = torch.randn(6, 9, generator=g)[:, 1:5], torch.randn(48, 4, generator=g)
    base = quantized_linear(fmt, x, tensors, bias)
    out = quantized_linear(fmt, x, tensors, bias, lora=(h, b))
    torch.testing.assert_close(out, base + (h @ b.t()).view(2, 3, 48), rtol=1e-5, atol=1e-5)


def _recording_grad_input(monkeypatch):
    """Wrap the layer's input-gradient entry to record the kernel policy it runs under (the real one still runs)."""
    from qerl.kernels.route import current_policy
    from qerl.nn import quant_linear

    seen = []
    real = quant_linear.quantized_linear_grad_input

    def recording(*args, **kwargs):
        seen.append(current_policy())
        return real(*args, **kwargs)

    monkeypatch.setattr(quant_linear, "quantized_linear_grad_input", recording)
    return seen


def test_backward_runs_under_the_forward_policy_even_on_another_thread(monkeypatch):
    """On CUDA autograd calls backward on a worker thread, which does not see the caller's `kernel_policy` scope:
    the policy in effect at forward time goes with the graph. Here the backward runs outside the scope and on a
    separate thread (as the CUDA engine would), and still sees it; the gradient is the reference one."""
    import threading

    from qerl.kernels.route import KernelPolicy, kernel_policy

    seen = _recording_grad_input(monkeypatch)
    layer, _ = make_layer("nvfp4", seed=3)
    x = torch.randn(5, layer.in_features, requires_grad=True)
    with kernel_policy(grad_input_no_temporary=True, fused_max_m=3):
        y = layer(x)
    t = threading.Thread(target=lambda: y.square().sum().backward())
    t.start()
    t.join()
    assert len(seen) == 1 and seen[0].grad_input_no_temporary and seen[0].fused_max_m == 3
    xr = x.detach().clone().requires_grad_()
    reference(layer, xr).square().sum().backward()
    assert torch.allclose(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    assert KernelPolicy().grad_input_no_temporary is False  # the default is untouched


def test_a_layer_routing_policy_wins_over_the_scope_and_survives_checkpoint_recompute(monkeypatch):
    """`set_routing_policy` pins the routing on the layers, so a non-reentrant activation-checkpoint recompute
    (which autograd runs inside backward) and its backward use it whatever scope they run in."""
    from torch.utils.checkpoint import checkpoint

    from qerl.kernels.route import KernelPolicy, kernel_policy
    from qerl.nn.quant_linear import set_routing_policy

    seen = _recording_grad_input(monkeypatch)
    first, _ = make_layer("nvfp4", seed=4)
    model = nn.Sequential(first, nn.GELU(), QuantLinear.from_linear(nn.Linear(OUT, 32), "nvfp4", LoraConfig(r=4)))
    pinned = KernelPolicy(grad_input_no_temporary=True)
    assert set_routing_policy(model, pinned) == 2
    x = torch.randn(3, model[0].in_features, requires_grad=True)
    with kernel_policy(fused_max_m=1):  # a scope the pinned layers ignore
        y = checkpoint(model, x, use_reentrant=False)
    y.sum().backward()
    assert len(seen) == 2 and all(p == pinned for p in seen)
    assert set_routing_policy(model, None) == 2 and model[0].routing_policy is None
