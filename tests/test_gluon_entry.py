"""`gluon.nvfp4.call_on_stored_weight`, the wrapper every Gluon NVFP4 entry runs its launch in, on CPU with a
plain-torch launch (the Gluon kernels themselves are GPU-tested): requirement checks, 3-D x, scale bytes as
stored, bias, and a LoRA term passed to the launch up to the epilogue width and added after it above."""

import pytest
import torch

from test_kernels_triton import _random_fp4

from qerl.formats.nvfp4 import dequantize_nvfp4

gluon_nvfp4 = pytest.importorskip("qerl.kernels.gluon.nvfp4")


def _launch_reference(calls):
    def launch(x2, packed, scale_u8, gs, b, sms, lo):
        calls.append(lo)
        assert x2.dim() == 2 and scale_u8.dtype == torch.uint8 and gs.dtype == torch.float32 and sms >= 1
        w = dequantize_nvfp4(packed, scale_u8.view(torch.float8_e4m3fn), gs, dtype=torch.float32)
        y = x2.float() @ w.t()
        if b is not None:
            y += b.float()
        if lo is not None:
            y += lo[0].float() @ lo[1].float().t()
        return y.to(torch.bfloat16)
    return launch


@pytest.mark.parametrize("r", [16, 160])
def test_wrapper_flattens_x_and_adds_a_wide_lora_after_the_launch(r):
    gen = torch.Generator().manual_seed(r)
    n, k = 40, 256
    w = _random_fp4(n, k, 16, False, gen, 900.0)
    x = torch.randn(2, 3, k, generator=gen).to(torch.bfloat16)
    h = torch.randn(2, 3, r, generator=gen).to(torch.bfloat16)
    lb = (torch.randn(n, r, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    calls = []
    y = gluon_nvfp4.call_on_stored_weight(x, **w, bias=bias, lora=(h, lb), launch=_launch_reference(calls))
    ref = x.view(6, k).float() @ dequantize_nvfp4(**w, dtype=torch.float32).t() + bias.float()
    ref += h.view(6, r).float() @ lb.float().t()
    assert y.shape == (2, 3, n) and y.dtype == torch.bfloat16
    assert torch.allclose(y.view(6, n).float(), ref, rtol=2e-2, atol=2e-2)
    assert (calls[0] is None) == (r > 128), "LoRA up to the epilogue width goes to the launch, wider ones after"


def test_wrapper_refuses_what_the_kernels_cannot_take():
    w = _random_fp4(8, 256, 16, False, torch.Generator().manual_seed(0), 900.0)
    never = _launch_reference([])
    with pytest.raises(ValueError, match="K % 128"):
        gluon_nvfp4.call_on_stored_weight(torch.randn(1, 256, dtype=torch.float16), **w, bias=None, lora=None,
                                          launch=never)
    with pytest.raises(ValueError, match="global scale"):
        small = dict(w, weight_global_scale=torch.tensor([100.0]))
        gluon_nvfp4.call_on_stored_weight(torch.randn(1, 256, dtype=torch.bfloat16), **small, bias=None, lora=None,
                                          launch=never)
