"""Fused FP4 Triton kernels (qerl.kernels.triton.fp4) against the plain-torch float32 reference.

The same checks run two ways:
  - on the CPU through the Triton interpreter, in a subprocess started with TRITON_INTERPRET=1 (Triton
    reads that variable when kernels are decorated or launched, so it must be set before Triton is
    imported; a subprocess keeps that true whatever this pytest process imported before);
  - on a GPU (`-m gpu`), directly, with larger shapes and every tile configuration the dispatch picks.
Inputs are fresh random tensors; weights are drawn as raw codes and scale bytes so that all 16 E2M1
codes, subnormal E4M3 scales, zero blocks and extreme global scales occur; every buffer the kernels
write is filled with NaN first (`workspace.poisoned_outputs`), so an unwritten element fails the check.
"""

import subprocess
import sys

import pytest
import torch

from kernel_testing import poisoned, require_cuda, run_interpreter_suite

from qerl.formats.mxfp4 import dequantize_mxfp4
from qerl.formats.nvfp4 import dequantize_nvfp4

# ||out - ref|| / ||ref|| for bf16 operands with float32 accumulation and a bf16 output is expected in
# 1e-3..1e-2 (bf16 keeps 8 significant bits); the measured error is ~2e-3, dominated by rounding the output
# and W to bf16.
REL_TOL = 1e-2

# (M, N, K): odd M and N, K a multiple of 16 (of 32 for MXFP4), tails in every dimension.
CPU_SHAPES = [(1, 24, 48), (3, 40, 96), (17, 33, 64), (5, 7, 160), (2, 64, 128)]
GPU_SHAPES = [(1, 4608, 3584), (7, 1000, 1040), (16, 3584, 18944), (33, 517, 784), (64, 2048, 4096),
              (100, 1000, 1008), (257, 1536, 2048), (1024, 1024, 1024)]


def _random_fp4(n: int, k: int, group: int, mx: bool, gen: torch.Generator, global_scale: float | None):
    """Random weight tensors (CPU): uniform codes (all 16), random scale bytes, some all-zero blocks."""
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    if mx:
        # E8M0 exponents around 2^0 (2^-20..2^20) plus the extremes the kernel handles exactly (0, 240)
        scale = torch.randint(107, 148, (n, k // group), generator=gen, dtype=torch.int32).to(torch.uint8)
        scale.view(-1)[:2] = torch.tensor([0, 240], dtype=torch.uint8)[: scale.numel()]
    else:
        # any finite positive E4M3 byte (0x00..0x7E): subnormals, 448 and zero included
        scale = torch.randint(0, 0x7F, (n, k // group), generator=gen, dtype=torch.int32).to(torch.uint8)
        scale = scale.view(torch.float8_e4m3fn)
    zero = torch.rand((n, k // group), generator=gen) < 0.1  # zero blocks: codes 0 and a zero scale
    packed.view(n, k // group, group // 2)[zero] = 0
    scale.view(torch.uint8)[zero] = 0
    tensors = {"weight_packed": packed, "weight_scale": scale}
    if not mx:
        tensors["weight_global_scale"] = torch.tensor([global_scale], dtype=torch.float32)
    return tensors


def _dequant(tensors: dict, mx: bool) -> torch.Tensor:
    return dequantize_mxfp4(**tensors) if mx else dequantize_nvfp4(**tensors)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")  # NaN poison left in place, or an overflow the reference does not have
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@poisoned
def _check_case(device: str, m: int, n: int, k: int, mx: bool, gs: float, dtype, seed: int, config=None) -> list[str]:
    """Forward (with bias) and input gradient of one shape; returns the failures as strings."""
    from qerl.kernels.triton import fp4 as tk

    gen = torch.Generator().manual_seed(seed)
    group = 32 if mx else 16
    t = _random_fp4(n, k, group, mx, gen, None if mx else gs)
    w = _dequant(t, mx)  # float32 reference weight [N, K]
    amax = w.abs().max().clamp_min(1e-30)
    x = torch.randn(m, k, generator=gen) / amax  # keep outputs O(sqrt(K)) whatever the scales
    g = torch.randn(m, n, generator=gen) / amax
    bias = torch.randn(n, generator=gen)
    xd, gd, bd = (v.to(device=device, dtype=dtype) for v in (x, g, bias))
    td = {name: v.to(device) for name, v in t.items()}
    ref_y = xd.double().cpu() @ w.double().T + bd.double().cpu()
    ref_g = gd.double().cpu() @ w.double()
    if mx:
        y = tk.mxfp4_linear_triton(xd, **td, bias=bd, config=config)
        dx = tk.mxfp4_grad_input_triton(gd, **td, config=config)
    else:
        y = tk.nvfp4_linear_triton(xd, **td, bias=bd, config=config)
        dx = tk.nvfp4_grad_input_triton(gd, **td, config=config)
    fails = []
    for name, out, ref, shape in (("forward", y, ref_y, (m, n)), ("grad_input", dx, ref_g, (m, k))):
        err = _rel_err(out, ref)
        if tuple(out.shape) != shape or out.dtype != dtype or not err < REL_TOL:
            fails.append(f"{'mx' if mx else 'nv'}fp4 {name} M={m} N={n} K={k} gs={gs} {dtype} {config}: "
                         f"rel err {err:.3g}, shape {tuple(out.shape)}, dtype {out.dtype}")
    return fails


@poisoned
def _check_decode_table(device: str) -> list[str]:
    """Every byte (all 16 x 16 code pairs) and every finite E4M3 / E8M0 scale, dequantized on the device,
    equals the torch dequantize (float32 out: exact up to one float32 rounding of the scale product)."""
    from qerl.kernels.triton import fp4 as tk

    fails = []
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).repeat(8, 1)  # [128, 16]
    e4m3 = torch.arange(128, dtype=torch.int32).to(torch.uint8)
    e4m3[127] = 0x38  # 0x7F is NaN: use 1.0 there
    nv = {"weight_packed": packed, "weight_scale": torch.stack([e4m3, e4m3.flip(0)], 1).view(torch.float8_e4m3fn)}
    for gs in (1.0, 2688.0 / 3.7, 1e-20, 1e20):
        nv["weight_global_scale"] = torch.tensor([gs])
        ref = dequantize_nvfp4(**nv)
        out = tk.nvfp4_dequantize_triton(**{a: b.to(device) for a, b in nv.items()}, dtype=torch.float32).cpu()
        if not torch.allclose(out, ref, rtol=1e-6, atol=0) or not torch.isfinite(out).all():
            fails.append(f"nvfp4 decode table gs={gs}: max diff {(out - ref).abs().max().item():.3g}")
        # bf16 out: on the GPU this takes the inline-PTX decode when gs > 128 (step rounded to bf16 first,
        # so two bf16 roundings of at most 2^-8 relative each)
        out16 = tk.nvfp4_dequantize_triton(**{a: b.to(device) for a, b in nv.items()}, dtype=torch.bfloat16).cpu()
        if not torch.allclose(out16.float(), ref, rtol=2.0**-7, atol=0) or not torch.isfinite(out16).all():
            fails.append(f"nvfp4 decode table bf16 gs={gs}: max rel diff "
                         f"{((out16.float() - ref).abs() / ref.abs().clamp_min(1e-38)).max().item():.3g}")
    e8m0 = torch.tensor([0, 1, 2, 100, 126, 127, 128, 200, 239, 240], dtype=torch.uint8).repeat(26)[:128]
    mx = {"weight_packed": packed[:, :16], "weight_scale": e8m0.reshape(128, 1)}
    ref = dequantize_mxfp4(**mx)
    out = tk.mxfp4_dequantize_triton(**{a: b.to(device) for a, b in mx.items()}, dtype=torch.float32).cpu()
    if not torch.equal(out, ref):
        fails.append(f"mxfp4 decode table: max diff {(out - ref).abs().max().item():.3g}")
    return fails


def interpreter_suite() -> list[str]:
    """All CPU checks; run in a subprocess with TRITON_INTERPRET=1 (see `test_interpreter`)."""
    from qerl.kernels.triton.fp4_mm import TileConfig

    fails = _check_decode_table("cpu")
    small = [None, TileConfig(16, 16, 32, split=2), TileConfig(32, 32, 64, split=3, prefetch=False)]
    for i, (m, n, k) in enumerate(CPU_SHAPES):
        for mx in (False, True):
            if mx and k % 32:
                continue
            for j, cfg in enumerate(small):
                gs = (2688.0, 1e-25, 1e25)[(i + j) % 3]  # huge weights, tiny weights, ordinary
                fails += _check_case("cpu", m, n, k, mx, gs, torch.bfloat16, seed=100 * i + j, config=cfg)
    fails += _check_case("cpu", 3, 40, 96, False, 700.0, torch.float16, seed=7)
    return fails


def test_interpreter():
    fails = run_interpreter_suite("test_kernels_triton", timeout=600)
    assert not fails, "\n".join(fails)


def test_import_without_triton_and_cpu_path_is_reference():
    """Importing qerl.kernels must not import Triton; CPU inputs take the plain-torch path."""
    code = ("import sys, torch; import qerl.kernels as k; from qerl.formats.nvfp4 import quantize_nvfp4; "
            "q = quantize_nvfp4(torch.randn(8, 32)); k.nvfp4_linear(torch.randn(2, 32), **q); "
            "k.nvfp4_linear_grad_input(torch.randn(2, 8), **q); print('triton' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_decode_table():
    require_cuda()
    fails = _check_decode_table("cuda")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("mx", [False, True], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_kernels(m, n, k, mx):
    require_cuda()
    if mx and k % 32:
        pytest.skip("MXFP4 needs K % 32 == 0")
    fails = []
    for i, gs in enumerate((2688.0 / 0.05, 1e-25, 1e25)):
        dtype = torch.float16 if (i == 2 and not mx) else torch.bfloat16
        if dtype == torch.float16:
            gs = 2688.0  # fp16 cannot hold the 1e25 weights; the range test is done in bf16
        fails += _check_case("cuda", m, n, k, mx, gs, dtype, seed=m * 7 + n + i)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_gpu_entry_points_and_autograd():
    """nvfp4_linear / quantized_linear route CUDA bf16 to the kernels; QuantLinear's backward matches."""
    require_cuda()
    from qerl.kernels import nvfp4_linear, quantized_linear_grad_input
    from qerl.formats.nvfp4 import quantize_nvfp4
    from qerl.nn.quant_linear import QuantLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(1040, 700, bias=True, device="cuda")
    layer = QuantLinear.from_linear(lin, "nvfp4").cuda()
    w = layer.dequantized_weight(torch.float32)
    x = torch.randn(4, 9, 1040, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.backward(torch.ones_like(y))
    ref_y = x.detach().double() @ w.double().T + lin.bias.detach().double()
    ref_dx = torch.ones(4, 9, 700, device="cuda", dtype=torch.float64) @ w.double()
    assert _rel_err(y.detach(), ref_y) < REL_TOL
    assert _rel_err(x.grad, ref_dx) < REL_TOL
    q = quantize_nvfp4(lin.weight)
    x2 = torch.randn(300, 1040, device="cuda", dtype=torch.bfloat16)
    assert _rel_err(nvfp4_linear(x2, **q), x2.double() @ dequantize_nvfp4(**q).double().T) < REL_TOL
    g2 = torch.randn(300, 700, device="cuda", dtype=torch.bfloat16)
    assert _rel_err(quantized_linear_grad_input("nvfp4", g2, q), g2.double() @ dequantize_nvfp4(**q).double()) < REL_TOL
