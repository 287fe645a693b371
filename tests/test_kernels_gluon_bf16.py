"""The Gluon bf16 decode kernel (qerl.kernels.gluon.bf16) against a float32 reference, and its route.

GPU only: Gluon kernels do not run under the Triton interpreter. Fresh random weights and activations (and
huge and all-zero rows), outputs and split-K partials NaN-poisoned first, odd M and N, K a multiple of 8 but
not always of the 128-column tile (the tail is zero-filled).
"""

import pytest
import torch

from kernel_testing import require_cuda
from test_kernels_triton import REL_TOL, _rel_err

pytestmark = pytest.mark.gpu

SHAPES = [(1, 200, 256), (3, 1000, 584), (8, 77, 1152), (13, 4608, 3584), (16, 333, 2048), (5, 3584, 18944)]


def _inputs(m, n, k, seed, r=0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    w[n // 3] = 0  # an all-zero weight row
    w[n // 2, : k // 2] *= 3e4  # a huge one
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
    h = torch.randn(m, r + 5, generator=gen).to(torch.bfloat16)[:, 3:3 + r] if r else None  # a column slice
    lb = (torch.randn(n, r, generator=gen) * 0.1).to(torch.bfloat16) if r else None
    return [t.cuda() if t is not None else None for t in (x, w, b, h, lb)]


def _reference(x, w, b=None, h=None, lb=None):
    ref = x.float() @ w.float().t()
    if b is not None:
        ref += b.float()
    if h is not None:
        ref += h.float() @ lb.float().t()
    return ref


def _kernel(x, w, b=None, lora=None, config=None, split=None):
    from qerl.kernels.gluon import bf16 as gluon_bf16
    from qerl.kernels.workspace import poisoned_outputs

    with poisoned_outputs():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return gluon_bf16.bf16_linear_swap(x, w, b, sms, config=config, split=split, lora=lora)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16_kernel_matches_reference(m, n, k):
    require_cuda()
    for r, bias, split in ((0, False, None), (16, True, None), (48, True, 3), (0, True, 1)):
        x, w, b, h, lb = _inputs(m, n, k, seed=m * 31 + n + r, r=r)
        b = b if bias else None
        y = _kernel(x, w, b, None if h is None else (h, lb), split=split)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) or NaN outputs"
        err = _rel_err(y, _reference(x, w, b, h, lb))
        assert err < REL_TOL, f"M={m} N={n} K={k} r={r} split={split}: rel err {err:.3g}"


@pytest.mark.parametrize("config", [(64, 8, 64, 2), (64, 16, 128, 3), (64, 32, 128, 4), (64, 64, 64, 3)])
def test_bf16_kernel_every_tile_and_split(config):
    require_cuda()
    for m in (1, config[1] - 1, config[1]):
        for split in (1, 2, 7, 1000):  # 1000: more splits than K tiles, clipped
            x, w, b, h, lb = _inputs(max(m, 1), 517, 1000, seed=m + split, r=16)
            y = _kernel(x, w, b, (h, lb), config=config, split=split)
            assert not torch.isnan(y).any()
            assert _rel_err(y, _reference(x, w, b, h, lb)) < REL_TOL


def test_bf16_kernel_under_graph_replay():
    """Split-K meets in one launch: a captured call replayed with fresh x equals the eager call bit for bit,
    and the arrival counters are back at zero."""
    require_cuda()
    from qerl.kernels.workspace import capture_graph, persistent_tensors

    x, w, b, h, lb = _inputs(8, 700, 2048, seed=3, r=16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    from qerl.kernels.gluon.bf16 import bf16_linear_swap

    def call():
        return bf16_linear_swap(x, w, b, sms, split=4, lora=(h, lb))

    graph, y = capture_graph(call)
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        x.copy_(torch.randn(x.shape, generator=gen))
        h.copy_(torch.randn(h.shape, generator=gen))
        graph.replay()
        eager = call()
        assert torch.equal(y, eager), f"replay {step}: graph and eager results differ"
        assert _rel_err(y, _reference(x, w, b, h, lb)) < REL_TOL
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in persistent_tensors("gluon")), "arrival counters not reset"


def test_bf16_linear_routes_decode_rows_to_the_kernel():
    """`bf16_linear` (the bf16 format's entry point): the kernel up to `KernelPolicy.bf16_swap_max_m` rows (the
    same bits as calling it directly), cuBLAS above; both equal the reference, with bias and LoRA, on [B, T, K]
    inputs."""
    require_cuda()
    from qerl.kernels import route as rt
    from qerl.kernels.bf16_matmul import bf16_linear

    top = rt.current_policy().bf16_swap_max_m
    for m in (1, 8, top, top + 1, 100):
        x, w, b, h, lb = _inputs(m, 1000, 3584, seed=m, r=16)
        y = bf16_linear(x.view(1, m, -1), w, b, (h, lb))
        assert y.shape == (1, m, 1000)
        assert _rel_err(y.view(m, -1), _reference(x, w, b, h, lb)) < REL_TOL
        if rt.route("bf16", m, 1000, 3584, torch.cuda.get_device_capability(), lora_r=16) == rt.GLUON_BF16:
            assert torch.equal(y.view(m, -1), _kernel(x, w, b, (h, lb)))


def test_bf16_kernel_declines_what_it_cannot_take():
    require_cuda()
    from qerl.kernels.gluon import bf16 as gluon_bf16

    x = torch.randn(4, 104, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 104, device="cuda", dtype=torch.bfloat16)
    assert gluon_bf16.supported(x, w) is True
    assert gluon_bf16.supported(x, w.t().contiguous().t()) is False  # column stride != 1
    assert gluon_bf16.supported(x.float(), w.float()) is False
    x = torch.randn(4, 102, device="cuda", dtype=torch.bfloat16)  # K % 8 != 0: rows not 16-byte aligned
    assert gluon_bf16.supported(x, torch.randn(64, 102, device="cuda", dtype=torch.bfloat16)) is False
