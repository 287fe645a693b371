"""The NVFP4 input-gradient kernel (qerl.kernels.gluon.nvfp4_grad_input) against the float32 reference.

GPU only (sm_90: wgmma, TMA, warp specialization; Gluon does not run under the Triton interpreter). Weights are
fresh random raw codes with every one of the 16 x 16 code pairs along row 0 (one byte's two output columns) and
down column 0 (the reduction pairs rows n, n + 1 of one byte column), scale bytes from subnormal to 448 and zero
blocks; outputs and split-K partials are NaN-poisoned first; M, N and K have tails of the kernel's tiles (256 dY
rows, 64 or 128 weight rows per step, 128 output columns). Besides the whole-tensor error, every output is
checked against its own rounding bound: a column written from the wrong accumulator row cannot hide in the norm.
"""

import pytest
import torch

from kernel_testing import poisoned, require_cuda
from test_kernels_triton import REL_TOL, _random_fp4, _rel_err

from qerl.formats.nvfp4 import dequantize_nvfp4
from qerl.kernels.workspace import capture_graph

pytestmark = pytest.mark.gpu


def _require_sm90():
    require_cuda()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the NVFP4 input-gradient kernel needs sm_90")


def _weight(n, k, gen, global_scale):
    w = _random_fp4(n, k, 16, False, gen, global_scale)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w["weight_packed"][0, :min(256, k // 2)] = codes[:k // 2]  # all code pairs of one byte (columns 2j, 2j + 1)
    w["weight_packed"][:min(256, n), 0] = codes[:n]  # and down a column (the pairs rows n, n + 1 reduce together)
    w["weight_scale"].view(torch.uint8)[0, :] = 0x38
    w["weight_scale"].view(torch.uint8)[:, 0] = 0x38
    return {name: t.cuda() for name, t in w.items()}


def _reference(g, w):
    """(g @ W in float32, |g| @ |W|: the scale of each output's rounding error)."""
    wf = dequantize_nvfp4(**w, dtype=torch.float32)
    return g.float() @ wf, g.float().abs() @ wf.abs()


def _check(y, refs, what):
    ref, scale = refs
    assert not torch.isnan(y).any(), f"{what}: unwritten (NaN-poisoned) or NaN outputs"
    err = _rel_err(y, ref)
    assert err < REL_TOL, f"{what}: rel err {err:.3g}"
    # bf16 weight steps and the bf16 output each round by <= 2^-9 of |g| @ |W|: 2^-6 leaves a 4x margin, while an
    # output written from the wrong accumulator row is off by the order of |g| @ |W| itself
    excess = ((y.float() - ref).abs() - scale * 2**-6).max().item()
    assert excess <= 0, f"{what}: an output is off by more than 2^-6 of its |g| @ |W| (by {excess:.3g} beyond)"


@poisoned
def _case(m, n, k, seed, global_scale=900.0, split=None, config=None):
    from qerl.kernels.gluon import nvfp4_grad_input as gi
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    gen = torch.Generator().manual_seed(seed)
    w = _weight(n, k, gen, global_scale)
    g = torch.randn(m, n, generator=gen).to(torch.bfloat16).cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    y = gi.nvfp4_grad_input_ws(g, w["weight_packed"], scale_bytes(w["weight_scale"]),
                               global_scale_f32(w["weight_global_scale"]), sms, split=split,
                               **({"config": config} if config else {}))
    assert y.dtype == torch.bfloat16 and y.shape == (m, k)
    _check(y, _reference(g, w), f"M={m} N={n} K={k} split={split} config={config}")


@pytest.mark.parametrize("m,n,k", [(1, 200, 512), (300, 8200, 2080), (1030, 336, 1024), (257, 1000, 544)])
def test_grad_input_kernel_matches_reference(m, n, k):
    _require_sm90()
    _case(m, n, k, seed=m + n)
    _case(m, n, k, seed=m + n + 1, global_scale=1e25)  # tiny weights: the bf16 step stays exact
    _case(m, n, k, seed=m + n + 2, split=3)


@pytest.mark.parametrize("config", [(256, 128, 3, 2, 232), (128, 64, 4, 2, 232), (64, 128, 4, 4, 112)])
def test_grad_input_kernel_other_tiles(config):
    """The other step (128 weight rows), 128- and 64-row dY tiles and four consumers, with split-K."""
    _require_sm90()
    _case(300, 1000, 2080, seed=sum(config), split=2, config=config)


@poisoned
def test_split_k_under_graph_replay_is_exact_and_resets_its_counters():
    """A captured split-K launch replayed with fresh dY equals the eager call bit for bit and the reference,
    and leaves the arrival counters at zero."""
    _require_sm90()
    from qerl.kernels.gluon import nvfp4_grad_input as gi
    from qerl.kernels.operands import global_scale_f32, scale_bytes
    from qerl.kernels.workspace import persistent_tensors

    m, n, k = 260, 2000, 1024
    gen = torch.Generator().manual_seed(3)
    w = _weight(n, k, gen, 900.0)
    ops = (w["weight_packed"], scale_bytes(w["weight_scale"]), global_scale_f32(w["weight_global_scale"]))
    g = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def call():
        return gi.nvfp4_grad_input_ws(g, *ops, sms, split=4)

    graph, y = capture_graph(call)
    for step in range(3):
        g.copy_(torch.randn(m, n, generator=gen))
        graph.replay()
        eager = call()
        assert torch.equal(y, eager), f"replay {step}: graph and eager results differ"
        _check(y, _reference(g, w), f"replay {step}")
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in persistent_tensors("gluon_grad_input")), "counters not reset"


def test_entry_takes_leading_dims_and_rejects_what_it_cannot_take():
    _require_sm90()
    from qerl.kernels.gluon.nvfp4_grad_input import nvfp4_grad_input_gluon

    gen = torch.Generator().manual_seed(0)
    w = _weight(264, 640, gen, 900.0)
    g = torch.randn(2, 70, 264, generator=gen).to(torch.bfloat16).cuda()
    y = nvfp4_grad_input_gluon(g, **w)
    assert y.shape == (2, 70, 640)
    _check(y.view(-1, 640), _reference(g.view(-1, 264), w), "3-D grad_out")
    with pytest.raises(ValueError, match="bf16 grad_out"):
        nvfp4_grad_input_gluon(g.half(), **w)
    w6 = _weight(262, 640, gen, 900.0)  # N % 8 != 0: dY rows are not 16-byte aligned for TMA
    with pytest.raises(ValueError, match="N % 8"):
        nvfp4_grad_input_gluon(torch.randn(4, 262, device="cuda", dtype=torch.bfloat16), **w6)
    small = {**w, "weight_global_scale": torch.tensor([100.0], device="cuda")}
    with pytest.raises(ValueError, match="global scale"):
        nvfp4_grad_input_gluon(g, **small)


def test_training_backward_routes_to_it_and_matches_the_reference():
    """The quantized layer's autograd backward at 200 rows on a weight of >= 2^26 elements reaches the kernel
    through `quantized_linear_grad_input`; with grad_input_no_temporary a small weight at 1030 rows does too."""
    _require_sm90()
    from qerl.kernels import route as rt
    from qerl.nn.quant_linear import _QuantizedMatmul

    gen = torch.Generator().manual_seed(11)
    for m, n, k, policy in ((200, 8200, 8192, {}), (1030, 1000, 2048, {"grad_input_no_temporary": True})):
        w = _weight(n, k, gen, 2688.0)
        assert rt.route("nvfp4", m, n, k, (9, 0), op="grad_input", policy=rt.KernelPolicy(**policy)) == \
            rt.GLUON_GRAD_INPUT
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
        g = torch.randn(m, n, generator=gen).to(torch.bfloat16).cuda()
        with rt.kernel_policy(**policy):
            y = _QuantizedMatmul.apply(x, "nvfp4", tuple(w), None, None, None, 1.0, None, *w.values())
            y.backward(g)
        _check(x.grad, _reference(g, w), f"autograd M={m} N={n} K={k} {policy}")
    assert rt.GLUON_GRAD_INPUT not in rt.unavailable()


def test_no_temporary_backward_never_allocates_a_dequantized_weight():
    """The point of `grad_input_no_temporary`: a CUDA backward (run by autograd on its worker thread) at 1030
    rows through an 8192 x 8192 NVFP4 weight peaks below half the 134 MB bf16 copy that the default route
    (dequantize + cuBLAS above 512 rows) allocates, which this test also sees."""
    _require_sm90()
    from qerl.kernels import route as rt
    from qerl.nn.quant_linear import _QuantizedMatmul

    m, n, k = 1030, 8192, 8192
    w = _weight(n, k, torch.Generator().manual_seed(12), 2688.0)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    policies = {"default": rt.KernelPolicy(), "no_temporary": rt.KernelPolicy(grad_input_no_temporary=True)}
    for name, policy in policies.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = _QuantizedMatmul.apply(x, "nvfp4", tuple(w), None, None, None, 1.0, policy, *w.values())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y.backward(g)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        _check(x.grad, _reference(g, w), f"{name} backward")
    temporary = n * k * 2
    assert peaks["default"] >= temporary, peaks  # the route dequantizes W there
    assert peaks["no_temporary"] < temporary // 2, peaks
