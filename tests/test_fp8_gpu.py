"""fp8 weights on FP8 tensor cores (qerl.kernels.fp8_matmul, sm_89+): the W8A8 product against the float64
product of the same quantized operands, at 1-512 rows and odd shapes (which take the dequantized path), NaN
propagated, and a QuantLinear's forward and input gradient on CUDA."""

import pytest
import torch

from kernel_testing import require_cuda

from qerl.formats import get_format
from qerl.kernels.fp8_matmul import fp8_linear, fp8_linear_reference, fp8_tensor_cores
from qerl.nn import LoraConfig, QuantLinear

pytestmark = pytest.mark.gpu
FP8 = get_format("fp8")


def _fp8_capable():
    require_cuda()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or newer")


@pytest.mark.parametrize("m", [1, 7, 64, 512])
@pytest.mark.parametrize("n,k", [(3584, 512), (512, 3584), (256, 1024)])
def test_w8a8_equals_the_product_of_the_quantized_operands(m, n, k):
    _fp8_capable()
    g = torch.Generator("cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    t = FP8.quantize(w)
    assert fp8_tensor_cores(x, t["weight"])
    y = fp8_linear(x, **t)
    ref = fp8_linear_reference(x, **t)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    # fp32 accumulation, one bf16 rounding of the output
    err = (y.double() - ref).abs()
    assert (err <= 2 ** -8 * ref.abs() + 1e-3 * ref.abs().max()).all(), float(err.max())


def test_odd_shapes_take_the_dequantized_path_and_nan_propagates():
    _fp8_capable()
    x = torch.randn(5, 100, device="cuda", dtype=torch.bfloat16)
    t = FP8.quantize(torch.randn(24, 100, device="cuda"))
    assert not fp8_tensor_cores(x, t["weight"])
    assert torch.equal(fp8_linear(x, **t), torch.nn.functional.linear(x, FP8.dequantize(**t, dtype=torch.bfloat16)))
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    x[2, 5] = float("nan")
    t = FP8.quantize(torch.randn(32, 128, device="cuda"))
    y = fp8_linear(x, **t)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()


def test_a_fp8_layer_trains_on_cuda():
    _fp8_capable()
    linear = torch.nn.Linear(256, 128, bias=True, device="cuda")
    layer = QuantLinear.from_linear(linear, "fp8", LoraConfig(r=8, alpha=16)).cuda()
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 0.02)
    x = torch.randn(3, 17, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert torch.isfinite(x.grad).all() and layer.lora_A.weight.grad.abs().max() > 0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp8_compute_on_tensor_cores_equals_its_emulation(fmt):
    """model.compute fp8 (W4A8) at rows that take FP8 tensor cores: the product against the float64 product of the
    same roundings, within the tensor cores' accumulation error (`test_w4a8_kernel.scaled_mm_tolerance`)."""
    _fp8_capable()
    from test_w4a8_kernel import scaled_mm_tolerance

    from qerl.formats.fp8 import as_fp8, quantize_rows_fp8
    from qerl.kernels.route import current_policy, kernel_policy

    linear = torch.nn.Linear(1024, 512, bias=False, device="cuda")
    layer = QuantLinear.from_linear(linear, fmt, None).cuda()
    x = torch.randn(current_policy().w4a8_min_m + 37, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), kernel_policy(compute="fp8"):
        y = layer(x)
    f = as_fp8(fmt, layer.quantized_tensors())
    ref = fp8_linear_reference(x, **f)
    q, s = quantize_rows_fp8(x)
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= scaled_mm_tolerance(q, s, f, ref, y.dtype)).all()


def test_w4a8_decode_in_captured_graphs_matches_eager_after_a_refresh():
    """model.compute fp8 with W4A8 on every decode row (`w4a8_min_m` 1): the engine's CUDA graphs give samples the
    loss pass scores as closely as an eager engine's, also on the second call (a refresh rebuilds the fused
    sibling views the graphs were captured with; shifts freed with the old views once turned the rollouts into
    noise). Each engine's gap is its log-probs against the loss pass's on its own samples."""
    _fp8_capable()
    from tiny import tiny_model

    from qerl.kernels.route import current_policy, kernel_policy
    from qerl.models import quantize_model
    from qerl.nn.quant_linear import set_routing_policy
    from qerl.rl.logprobs import completion_logprobs
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    base = tiny_model("qwen2", hidden_size=256, intermediate_size=512).cuda().to(torch.bfloat16)
    model = quantize_model(base, "nvfp4", LoraConfig(r=16, alpha=32))
    policy = current_policy().__class__(compute="fp8", w4a8_min_m=1)
    set_routing_policy(model, policy)  # the loss pass
    prompts = torch.randint(3, 150, (8, 6), generator=torch.Generator().manual_seed(7)).cuda()

    def gap(graphs: bool) -> float:
        engine = RolloutEngine(model, max_seq_len=64, cuda_graphs=graphs)
        with kernel_policy(policy):
            engine.generate(prompts, 16, SamplingParams(temperature=1.0), seed=0, ignore_eos=True)
            with torch.no_grad():  # the trainer's update moves the adapter between rollouts: a refresh
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p) * 1e-3)
            r = engine.generate(prompts, 16, SamplingParams(temperature=1.0), seed=1, ignore_eos=True)
        with torch.no_grad():
            lp = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        assert torch.isfinite(r.logprobs).all()
        return float((lp - r.logprobs).abs().mean())

    eager, graphs = gap(False), gap(True)
    assert graphs <= 2 * eager + 0.02, (graphs, eager)
