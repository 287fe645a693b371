"""The warp-specialized NVFP4 kernel (`gluon_nvfp4_ws`, sm_90) against the float64 reference: all 16 FP4 codes,
zero blocks, a huge-scale block, odd M / N tails, bias, NaN-poisoned outputs. GPU only (Gluon has no interpreter)."""

import pytest
import torch
from kernel_testing import require_cuda
from test_kernels_triton import _random_fp4

from qerl.formats.nvfp4 import dequantize_nvfp4
from qerl.kernels.workspace import poisoned_outputs


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (77, 200, 256), (129, 130, 640), (300, 4608, 3584), (512, 256, 1024)])
@pytest.mark.parametrize("config", [None, (128, 128, 64, 4, 4, 8, 4, 128, 4)])
def test_gpu_ws_matches_reference(m, n, k, config):
    require_cuda()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized kernel is sm_90 only")
    from qerl.kernels.gluon_nvfp4_ws import nvfp4_linear_ws
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    gen = torch.Generator().manual_seed(m * 7 + n)
    w = _random_fp4(n, k, 16, False, gen, 900.0)
    w["weight_scale"].view(torch.uint8)[0, 0] = 0x7E  # 448: the largest E4M3 scale
    w = {a: t.cuda() for a, t in w.items()}
    x = torch.randn(m, k, generator=gen).bfloat16().cuda()
    b = (torch.randn(n, generator=gen) * 0.1).bfloat16().cuda()
    with poisoned_outputs():
        y = nvfp4_linear_ws(x, w["weight_packed"], scale_bytes(w["weight_scale"]),
                            global_scale_f32(w["weight_global_scale"]), b, config=config)
    ref = x.double() @ dequantize_nvfp4(**w, dtype=torch.float32).double().t() + b.double()
    assert not torch.isnan(y).any()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 5e-3, err  # bf16 output rounding and fp32 accumulation
