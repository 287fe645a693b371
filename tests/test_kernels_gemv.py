"""CUDA-core decode kernel (qerl.kernels.triton.fp4_gemv, M = 1..16) against the plain-torch float32 reference.

Same standard as tests/test_kernels_triton.py (whose helpers it reuses): fresh random weights drawn as raw
codes and scale bytes (all 16 E2M1 codes, subnormal E4M3 scales, zero blocks), extreme global scales,
odd N, K a multiple of 16 with K % 32 == 16 tails (the kernel's masked path), M in {1, 2, 3, 8, 16},
split-K on and off, and every buffer the kernels write (output, split-K partials) filled with NaN first.
CPU: through the Triton interpreter in a subprocess (TRITON_INTERPRET=1); GPU: `-m gpu`, Qwen2.5 shapes.
"""

import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernel_testing import poisoned, require_cuda, run_interpreter_suite  # noqa: E402
from test_kernels_triton import REL_TOL, _random_fp4, _rel_err  # noqa: E402

from qerl.formats.nvfp4 import dequantize_nvfp4  # noqa: E402

M_VALUES = (1, 2, 3, 8, 16)
CPU_SHAPES = [(24, 48), (33, 160), (7, 64), (40, 96)]  # (N, K): K % 32 == 16 in the first two
GPU_SHAPES = [(4608, 3584), (3584, 18944), (1000, 1040), (517, 784),
              pytest.param(7168, 5120, marks=pytest.mark.slow), pytest.param(10240, 8192, marks=pytest.mark.slow)]


@functools.lru_cache(maxsize=2)
def _weights(n: int, k: int, gs: float, seed: int) -> tuple[dict, torch.Tensor]:
    """Random NVFP4 tensors for an [n, k] weight and their float64 dequantization, kept for the next cases:
    drawing and dequantizing a 10240 x 8192 weight on the CPU costs more than the kernel calls it feeds."""
    t = _random_fp4(n, k, 16, False, torch.Generator().manual_seed(seed), gs)
    return t, dequantize_nvfp4(**t).double()


@poisoned
def _check_case(device, m, n, k, gs, dtype, seed, config=None, bias=True, entry=False) -> list[str]:
    """One call against the float64 reference; the weight depends on (n, k, gs, seed), x and the bias on
    (seed, m) too."""
    from qerl.kernels import nvfp4_linear
    from qerl.kernels.triton import fp4 as tk

    t, w = _weights(n, k, gs, seed)
    gen = torch.Generator().manual_seed(seed * 1000 + m)
    amax = w.abs().max().clamp_min(1e-30).float()
    x = torch.randn(m, k, generator=gen) / amax
    b = torch.randn(n, generator=gen) if bias else None
    xd = x.to(device=device, dtype=dtype)
    bd = None if b is None else b.to(device=device, dtype=dtype)
    td = {a: v.to(device) for a, v in t.items()}
    ref = xd.double().cpu() @ w.T + (0 if b is None else bd.double().cpu())
    if entry:
        y = nvfp4_linear(xd, **td, bias=bd)
    else:
        y = tk.nvfp4_linear_gemv(xd, **td, bias=bd, config=config)
    err = _rel_err(y, ref)
    if tuple(y.shape) != (m, n) or y.dtype != dtype or not err < REL_TOL:
        return [f"gemv M={m} N={n} K={k} gs={gs} {dtype} {config} entry={entry}: rel err {err:.3g}, "
                f"shape {tuple(y.shape)}, dtype {y.dtype}"]
    return []


@poisoned
def _check_decode_table(device: str) -> list[str]:
    """All 256 code pairs and all 127 finite E4M3 scales through the kernel: x = rows of the identity, so
    y[m, n] = W[n, col] exactly up to the final rounding of one fp32 product (to bf16: <= 2^-8 relative)."""
    from qerl.kernels.triton import fp4 as tk

    fails = []
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).repeat(8, 1)  # [128, 16]: K=32
    e4m3 = torch.arange(128, dtype=torch.int32).to(torch.uint8)
    e4m3[127] = 0x38  # 0x7F is NaN
    t = {"weight_packed": packed, "weight_scale": torch.stack([e4m3, e4m3.flip(0)], 1).view(torch.float8_e4m3fn)}
    from qerl.kernels.triton.fp4_gemv import GemvConfig

    for gs in (1.0, 2688.0 / 3.7, 1e-20, 1e20):
        t["weight_global_scale"] = torch.tensor([gs])
        ref = dequantize_nvfp4(**t)  # [128, 32] float32
        for half in (0, 1):
            x = torch.zeros(16, 32)
            x[:, 16 * half:16 * half + 16] = torch.eye(16)
            for cfg in (None, GemvConfig(32, 4, 1, 1)):
                y = tk.nvfp4_linear_gemv(x.to(device, torch.bfloat16), **{a: v.to(device) for a, v in t.items()},
                                         config=cfg).float().cpu()
                want = ref[:, 16 * half:16 * half + 16].T
                bad = ~torch.isclose(y, want, rtol=2.0**-8, atol=0) | ~torch.isfinite(y)
                if bad.any():
                    fails.append(f"gemv decode table gs={gs} half={half} {cfg}: {int(bad.sum())} wrong, e.g. "
                                 f"{y[bad][:3].tolist()} vs {want[bad][:3].tolist()}")
    return fails


def interpreter_suite() -> list[str]:
    from qerl.kernels.triton.fp4_gemv import GemvConfig

    fails = _check_decode_table("cpu")
    cfgs = [None, GemvConfig(32, 4, 1, 1), GemvConfig(64, 4, 1, 3), GemvConfig(32, 2, 1, 2)]
    for i, (n, k) in enumerate(CPU_SHAPES):
        for j, m in enumerate(M_VALUES):
            gs = (2688.0, 1e-25, 1e25)[(i + j) % 3]
            fails += _check_case("cpu", m, n, k, gs, torch.bfloat16, seed=100 * i + j, config=cfgs[(i + j) % 4],
                                 bias=(i + j) % 2 == 0)
    fails += _check_case("cpu", 3, 40, 96, 700.0, torch.float16, seed=7)
    return fails


def test_interpreter():
    fails = run_interpreter_suite("test_kernels_gemv")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_gpu_decode_table():
    require_cuda()
    fails = _check_decode_table("cuda")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_gemv(n, k):
    require_cuda()
    from qerl.kernels.triton.fp4_gemv import GemvConfig

    fails = []
    for j, gs in enumerate((2688.0 / 0.05, 1e-25, 1e25)):  # weights drawn once per global scale, x per M
        for m in M_VALUES:
            fails += _check_case("cuda", m, n, k, gs, torch.bfloat16, seed=n + j)
    # fp16 and the forced tile configs at a few M each (every M is a separate compile); the full M sweep stays
    # on the default tiles above and on the routed entry below
    for m in (1, 3, 16):
        fails += _check_case("cuda", m, n, k, 2688.0, torch.float16, seed=n + 3)
    for m, config in ((1, GemvConfig(256, 4, 4, 0)), (16, GemvConfig(256, 4, 4, 0)), (3, GemvConfig(64, 8, 2, 1)),
                      (8, GemvConfig(64, 8, 2, 1))):
        fails += _check_case("cuda", m, n, k, 300.0, torch.bfloat16, seed=n + 4, config=config)
    for m in M_VALUES:
        fails += _check_case("cuda", m, n, k, 300.0, torch.bfloat16, seed=n + 4, entry=True)  # the routing
    assert not fails, "\n".join(fails)
