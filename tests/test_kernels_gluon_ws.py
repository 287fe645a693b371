"""The warp-specialized NVFP4 wgmma kernel (qerl.kernels.gluon.nvfp4_wgmma_ws) against the float32 reference.

GPU only (sm_90: wgmma, TMA, warp specialization; Gluon does not run under the Triton interpreter). Weights are
fresh random raw codes with every one of the 16 x 16 code pairs in row 0, scale bytes from subnormal to 448 and
zero blocks; outputs and split-K partials are NaN-poisoned first; M and N have tails of the 256-row and 128-row
tiles.
"""

import pytest
import torch

from kernel_testing import poisoned, require_cuda
from test_kernels_gluon import _activations
from test_kernels_triton import REL_TOL, _random_fp4, _rel_err

from qerl.formats.nvfp4 import dequantize_nvfp4
from qerl.kernels import route as rt
from qerl.kernels.workspace import capture_graph

pytestmark = pytest.mark.gpu


def _require_sm90():
    require_cuda()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized wgmma kernel needs sm_90")


def _weight(n, k, gen, global_scale):
    w = _random_fp4(n, k, 16, False, gen, global_scale)
    w["weight_packed"][0, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # all 16 x 16 code pairs
    w["weight_scale"].view(torch.uint8)[0, :16] = 0x38  # keep row 0's code table out of the zero blocks
    return {name: t.cuda() for name, t in w.items()}


def _reference(x, w, bias, lora):
    ref = x.float() @ dequantize_nvfp4(**w, dtype=torch.float32).t()
    if bias is not None:
        ref += bias.float()
    if lora is not None:
        ref += lora[0].float() @ lora[1].float().t()
    return ref


@poisoned
def _case(m, n, k, seed, global_scale=900.0, bias=False, lora_r=0, split=None, config=None):
    from qerl.kernels.gluon import nvfp4_wgmma_ws as gw
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    gen = torch.Generator().manual_seed(seed)
    w = _weight(n, k, gen, global_scale)
    x, b, lora = _activations(m, n, k, gen, bias, lora_r)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    y = gw.nvfp4_linear_ws(x, w["weight_packed"], scale_bytes(w["weight_scale"]),
                           global_scale_f32(w["weight_global_scale"]), b, sms, split=split, lora=lora,
                           **({"config": config} if config else {}))
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) or NaN outputs"
    err = _rel_err(y, _reference(x, w, b, lora))
    assert err < REL_TOL, f"M={m} N={n} K={k} split={split} lora_r={lora_r}: rel err {err:.3g}"


@pytest.mark.parametrize("m,n,k", [(1, 200, 512), (300, 8200, 2048), (1030, 333, 1024)])
def test_ws_kernel_matches_reference(m, n, k):
    _require_sm90()
    _case(m, n, k, seed=m + n, bias=m % 2 == 0)
    _case(m, n, k, seed=m + n + 1, global_scale=1e25)  # tiny weights: the bf16 step stays exact
    _case(m, n, k, seed=m + n + 2, bias=True, lora_r=48, split=3)


@pytest.mark.slow
@pytest.mark.parametrize("config", [(128, 64, 4, 232), (64, 64, 4, 200)])
def test_ws_kernel_other_tiles(config):
    """Tiles other than the routed one (BM 256, 3 stages), with bias, LoRA and split-K (the benchmark's options)."""
    _require_sm90()
    _case(300, 700, 2048, seed=sum(config), bias=True, lora_r=16, split=2, config=config)


def test_router_sends_wide_weights_at_256_to_1024_rows_to_it():
    """`nvfp4_linear` on a weight of >= 8192 rows and >= 2^27 elements at 256-1024 rows takes the kernel
    (3-D x, bias, LoRA) and equals the reference; outside the rule it does not."""
    _require_sm90()
    from qerl.kernels.nvfp4_matmul import nvfp4_linear

    n, k = 8200, 16384
    assert rt.route("nvfp4", 256, n, k, (9, 0)) == rt.GLUON_WGMMA_WS
    assert rt.route("nvfp4", 1025, n, k, (9, 0)) != rt.GLUON_WGMMA_WS
    gen = torch.Generator().manual_seed(5)
    w = _weight(n, k, gen, 2688.0)
    x = torch.randn(2, 150, k, generator=gen).to(torch.bfloat16).cuda()
    h = torch.randn(2, 150, 16, generator=gen).to(torch.bfloat16).cuda()
    lb = (torch.randn(n, 16, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    y = nvfp4_linear(x, **w, bias=bias, lora=(h, lb))
    assert y.shape == (2, 150, n) and not torch.isnan(y).any()
    ref = _reference(x.view(-1, k), w, bias, (h.view(-1, 16), lb))
    assert _rel_err(y.view(-1, n), ref) < REL_TOL
    assert rt.GLUON_WGMMA_WS not in rt.unavailable()


@poisoned
def test_split_k_under_graph_replay_is_exact_and_resets_its_counters():
    """A captured split-K launch replayed with fresh x equals the eager call bit for bit and the reference,
    and leaves the arrival counters at zero."""
    _require_sm90()
    from qerl.kernels.gluon import nvfp4_wgmma_ws as gw
    from qerl.kernels.operands import global_scale_f32, scale_bytes
    from qerl.kernels.workspace import persistent_tensors

    m, n, k, r = 260, 700, 2048, 16
    gen = torch.Generator().manual_seed(3)
    w = _weight(n, k, gen, 900.0)
    ops = (w["weight_packed"], scale_bytes(w["weight_scale"]), global_scale_f32(w["weight_global_scale"]))
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    lb = (torch.randn(n, r, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    h = torch.zeros(m, r, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def call():
        return gw.nvfp4_linear_ws(x, *ops, b, sms, split=4, lora=(h, lb))

    graph, y = capture_graph(call)
    for step in range(3):
        x.copy_(torch.randn(m, k, generator=gen))
        h.copy_(torch.randn(m, r, generator=gen))
        graph.replay()
        eager = call()
        assert not torch.isnan(y).any()
        assert torch.equal(y, eager), f"replay {step}: graph and eager results differ"
        assert _rel_err(y, _reference(x, w, b, (h, lb))) < REL_TOL
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in persistent_tensors("gluon_ws")), "arrival counters not reset"


def test_inputs_the_kernel_cannot_take_raise():
    _require_sm90()
    from qerl.kernels.gluon.nvfp4_wgmma_ws import nvfp4_linear_ws_gluon

    w = _weight(256, 640, torch.Generator().manual_seed(0), 900.0)
    with pytest.raises(ValueError, match="K % 128"):
        nvfp4_linear_ws_gluon(torch.randn(4, 640, device="cuda", dtype=torch.float16), **w)
    w = {name: t[:, :160] if name == "weight_packed" else t for name, t in w.items()}
    with pytest.raises(ValueError, match="K % 128"):
        nvfp4_linear_ws_gluon(torch.randn(4, 320, device="cuda", dtype=torch.bfloat16), **w)
