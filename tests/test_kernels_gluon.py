"""The Gluon swap-AB NVFP4 decode kernel (qerl.kernels.gluon.nvfp4) against the plain-torch float32 reference.

GPU only: Gluon kernels do not run under the Triton interpreter. Weights are fresh random raw codes and
scale bytes (all 16 E2M1 codes, subnormal and maximal E4M3 scales, zero blocks), outputs and split-K
partials are NaN-poisoned first, shapes have odd M and N, and K is any multiple of 128 (the kernel's
requirement; it declines other shapes, checked too).
"""

import pytest
import torch

from kernel_testing import poisoned, require_cuda
from test_kernels_triton import REL_TOL, _random_fp4, _rel_err

from qerl.formats.nvfp4 import dequantize_nvfp4
from qerl.kernels import route as rt
from qerl.kernels.workspace import capture_graph

pytestmark = pytest.mark.gpu

# (M, N, K): M across the 8/16/32/64-row tiles, N not a multiple of the 64/128/256-row tiles, K % 128 == 0
SHAPES = [(1, 200, 256), (3, 1000, 384), (8, 77, 1152), (13, 4608, 3584), (16, 333, 2048), (21, 517, 1024),
          (32, 64, 640), (33, 1000, 1024), (64, 96, 3584)]


def _activations(m, n, k, gen, bias, lora_r):
    """(x [m, k], bias [n] or None, LoRA (h [m, r], lb [n, r]) or None), bf16 on the GPU; h is a column slice of
    a wider matrix, as the engine passes it."""
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16).cuda() if bias else None
    lora = None
    if lora_r:
        h = torch.randn(m, lora_r + 5, generator=gen).to(torch.bfloat16).cuda()[:, 3:3 + lora_r]
        lora = (h, (torch.randn(n, lora_r, generator=gen) * 0.1).to(torch.bfloat16).cuda())
    return x, b, lora


@poisoned
def _case(m, n, k, seed, global_scale, bias, config=None, split=None, lora_r=0, wgmma=None, x_permuted=None):
    """One call of the Gluon kernel against the reference; wgmma None: the form `route` picks on this GPU."""
    from qerl.kernels.gluon import nvfp4 as gluon_nvfp4

    gen = torch.Generator().manual_seed(seed)
    w = {name: t.cuda() for name, t in _random_fp4(n, k, 16, False, gen, global_scale).items()}
    x, b, lora = _activations(m, n, k, gen, bias, lora_r)
    if wgmma is None:
        backend = rt.route("nvfp4", m, n, k, torch.cuda.get_device_capability(), lora_r=lora_r)
        assert backend in rt.GLUON_NVFP4, f"the route does not send M={m} N={n} K={k} to the Gluon kernel"
        wgmma = backend != rt.GLUON_MMA
    y = gluon_nvfp4.nvfp4_linear_gluon(x, **w, bias=b, config=config, split=split, lora=lora, wgmma=wgmma,
                                       x_permuted=x_permuted)
    ref = x.float() @ dequantize_nvfp4(**w, dtype=torch.float32).t()
    if b is not None:
        ref += b.float()
    if lora is not None:
        ref += lora[0].float() @ lora[1].float().t()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) or NaN outputs"
    err = _rel_err(y, ref)
    assert err < REL_TOL, f"M={m} N={n} K={k} gs={global_scale}: rel err {err:.3g}"


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_swap_kernel_matches_reference(m, n, k):
    require_cuda()
    _case(m, n, k, seed=m * 7 + n, global_scale=2688.0, bias=m % 2 == 1)
    _case(m, n, k, seed=m * 7 + n + 1, global_scale=1e25, bias=False)  # tiny weights: the step stays exact


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("m,n,k", [s for s in SHAPES if s[0] >= 8])
def test_mma_sync_and_wgmma_forms(m, n, k, wgmma):
    """Both tensor-core forms at every row count the router may send them (the default picks wgmma for
    9-64 rows on sm_90, and 5-8 rows for the largest weights), with bias, a LoRA term and split-K."""
    require_cuda()
    if wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    for lora_r in (0, 48):
        _case(m, n, k, seed=m + n + lora_r, global_scale=2688.0, bias=True, lora_r=lora_r, wgmma=wgmma)
    _case(m, n, k, seed=m + n + 1, global_scale=900.0, bias=False, split=3, lora_r=16, wgmma=wgmma,
          config=(128, 64, 64, 16, 4) if wgmma else None)


@pytest.mark.parametrize("x_permuted", [False, True])
def test_wgmma_with_x_staged_or_pre_permuted(x_permuted):
    """The wgmma form with x staged through registers every step, or rewritten once in operand order by
    `permute_x_kernel` (NaN-poisoned, so an unwritten element shows) and copied by cp.async."""
    require_cuda()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    for m, n, k in [(5, 300, 1024), (16, 700, 1280), (40, 1000, 2048), (64, 96, 3584), (100, 517, 1024)]:
        for split in (1, 3):
            _case(m, n, k, seed=m + split, global_scale=900.0, bias=split == 1, split=split,
                  lora_r=16 if split == 3 else 0, wgmma=True, x_permuted=x_permuted)
    _case(64, 200, 1024, seed=5, global_scale=900.0, bias=True, config=(64, 64, 128, 16, 3), wgmma=True,
          x_permuted=x_permuted)


@pytest.mark.parametrize("policy", [{}, {"wide_m_tile": 128, "permute_x_min_weight": 0, "wide_m_min_k_tiles": 1}])
def test_wgmma_takes_65_to_256_rows_through_the_dispatch(policy):
    """Above 64 rows on sm_90 the router sends the forward to the wgmma form (up to 128 rows for every weight,
    256 for weights of >= 32M elements; x staged for weights under 8M elements, 64-row activation tiles under
    32M, short K split no finer than 3 tiles; and under the earlier rule, 128-row tiles with x pre-permuted):
    `nvfp4_linear` with bias and a LoRA term equals the reference there, and past the rule dequantize + cuBLAS
    takes them."""
    require_cuda()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    from qerl.kernels.nvfp4_matmul import nvfp4_linear

    with rt.kernel_policy(**policy):
        _wide_m_cases(nvfp4_linear, staged_below=rt.current_policy().permute_x_min_weight)


def _wide_m_cases(nvfp4_linear, staged_below):
    for m, n, k, split in [(65, 333, 1024, None), (100, 1000, 2048, 3), (128, 2048, 1536, None),
                           (96, 1536, 8960, None), (128, 4608, 3584, None), (200, 8200, 4096, None),
                           (256, 8192, 4096, 2)]:
        xp = n * k >= staged_below
        assert rt.route("nvfp4", m, n, k, (9, 0)) == (rt.GLUON_WGMMA_XP if xp else rt.GLUON_WGMMA)
        _case(m, n, k, seed=m, global_scale=900.0, bias=True, split=split, lora_r=16 if m % 2 else 0)
        gen = torch.Generator().manual_seed(m + 1)
        w = {name: t.cuda() for name, t in _random_fp4(n, k, 16, False, gen, 2688.0).items()}
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        h = torch.randn(m, 16, generator=gen).to(torch.bfloat16).cuda()
        lb = (torch.randn(n, 16, generator=gen) * 0.1).to(torch.bfloat16).cuda()
        bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16).cuda()
        y = nvfp4_linear(x, **w, bias=bias, lora=(h, lb))
        ref = x.float() @ dequantize_nvfp4(**w, dtype=torch.float32).t() + bias.float() + h.float() @ lb.float().t()
        assert not torch.isnan(y).any() and _rel_err(y, ref) < REL_TOL
    for m, n, k in [(129, 1000, 1024), (257, 8192, 4096)]:  # past the rule: dequantize + cuBLAS
        assert rt.route("nvfp4", m, n, k, (9, 0)) == rt.TRITON_DEQUANTIZE
        gen = torch.Generator().manual_seed(m)
        w = {name: t.cuda() for name, t in _random_fp4(n, k, 16, False, gen, 2688.0).items()}
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        assert _rel_err(nvfp4_linear(x, **w), x.float() @ dequantize_nvfp4(**w, dtype=torch.float32).t()) < REL_TOL


@pytest.mark.parametrize("wgmma,x_permuted", [(False, None), (True, False), (True, True)])
@poisoned
def test_split_k_meets_in_one_launch_under_graph_replay(wgmma, x_permuted):
    """Split-K partials are summed by the last program to arrive: a captured launch replayed with fresh x
    equals the eager call bit for bit (fixed summation order) and the reference; the arrival counters are
    left at zero (else the next replay would finish a tile early). The wgmma form with x pre-permuted also
    captures its permute launch."""
    require_cuda()
    if wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    from qerl.kernels.gluon import nvfp4 as gluon_nvfp4
    from qerl.kernels.workspace import persistent_tensors

    m, n, k, r = (40, 700, 2048, 16) if wgmma else (5, 700, 2048, 16)
    gen = torch.Generator().manual_seed(11 + wgmma)
    w = {name: t.cuda() for name, t in _random_fp4(n, k, 16, False, gen, 900.0).items()}
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    lb = (torch.randn(n, r, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    h = torch.zeros(m, r, dtype=torch.bfloat16, device="cuda")

    def call():
        # wgmma: x staged (x_permuted False), or rewritten once per call (True)
        return gluon_nvfp4.nvfp4_linear_gluon(x, **w, bias=b, split=4, lora=(h, lb), wgmma=wgmma,
                                              x_permuted=x_permuted)

    graph, y = capture_graph(call)
    wref = dequantize_nvfp4(**w, dtype=torch.float32)
    for step in range(4):
        x.copy_(torch.randn(m, k, generator=gen))
        h.copy_(torch.randn(m, r, generator=gen))
        graph.replay()
        eager = call()
        ref = x.float() @ wref.t() + b.float() + h.float() @ lb.float().t()
        assert not torch.isnan(y).any()
        assert torch.equal(y, eager), f"replay {step}: graph and eager results differ"
        assert _rel_err(y, ref) < REL_TOL
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in persistent_tensors("gluon")), "arrival counters not reset"


@pytest.mark.parametrize("split", [1, 2, 5])
def test_swap_kernel_every_split_and_tile(split):
    require_cuda()
    for cfg in [(128, 8, 128, 16, 4), (64, 8, 128, 16, 3), (64, 16, 128, 16, 4), (128, 32, 64, 16, 3),
                (256, 64, 64, 16, 3)]:
        _case(cfg[1] - 1, 700, 1280, seed=split * 100 + cfg[1], global_scale=900.0, bias=True, config=cfg,
              split=split)


@pytest.mark.parametrize("r", [8, 16, 40, 96, 160])
def test_swap_kernel_adds_the_lora_delta(r):
    """h @ (scaling B)^T in the same launch: with one split (epilogue) and several (split 0 only)."""
    require_cuda()
    for split in (1, 3):
        _case(5, 700, 1280, seed=r + split, global_scale=900.0, bias=True, config=(64, 8, 128, 16, 4),
              split=split, lora_r=r)
        _case(40, 333, 1024, seed=r + split + 50, global_scale=900.0, bias=False, config=(128, 64, 64, 16, 4),
              split=split, lora_r=r)


def test_shapes_the_swap_kernel_cannot_take_route_elsewhere():
    """K % 128 != 0, a global scale <= 128, fp16 x: the route sends them to the Triton kernels, the Gluon
    entry refuses them if called anyway, and `nvfp4_linear` still answers."""
    require_cuda()
    from qerl.kernels import nvfp4_linear
    from qerl.kernels.gluon import nvfp4 as gluon_nvfp4
    from qerl.kernels.operands import step_fits_bf16

    gen = torch.Generator().manual_seed(0)
    for k, gs, dtype in [(576, 2688.0, torch.bfloat16), (1024, 1.0, torch.bfloat16), (1024, 2688.0, torch.float16)]:
        w = {name: t.cuda() for name, t in _random_fp4(64, k, 16, False, gen, gs).items()}
        x = torch.randn(4, k, device="cuda", dtype=dtype)
        backend = rt.route("nvfp4", 4, 64, k, torch.cuda.get_device_capability(), dtype=dtype,
                           step_fits=step_fits_bf16(w["weight_global_scale"]))
        assert backend == rt.TRITON_DOT
        with pytest.raises(ValueError):
            gluon_nvfp4.nvfp4_linear_gluon(x, **w)
        ref = x.float() @ dequantize_nvfp4(**w, dtype=torch.float32).t()
        assert _rel_err(nvfp4_linear(x, **w), ref) < REL_TOL
