"""The routing rule `qerl.kernels.route.route` as a table (CPU only: the rule is pure, no kernel runs).

Shapes are Qwen2.5 layers (N, K): 7B q/k/v 4608x3584 (16.5M elements), 7B gate_up 37888x3584 (136M),
7B down 3584x18944 (68M), 72B o 8192x8192 (67M), 72B down 8192x29568 (242M), SmolLM2 k/v 192x576
(K % 128 != 0). Capabilities: (8, 0) A100, (8, 9) L4,
(9, 0) H100/H200, (10, 0) B200, (12, 0) RTX 50xx, None = CPU input or Triton off.
"""

import pytest
import torch

from qerl.kernels import route as rt

QKV, GATE_UP, O72, SMOL = (4608, 3584), (37888, 3584), (8192, 8192), (192, 576)
DOWN, DOWN72 = (3584, 18944), (8192, 29568)
H100, A100, B200 = (9, 0), (8, 0), (10, 0)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (fmt, op, M, (N, K), capability, dtype, lora_r, step_fits) -> backend
TABLE = [
    # NVFP4 forward on Hopper: mma.sync at 1-4 rows, wgmma from 9 (5 for weights >= 100M elements)
    ("nvfp4", "forward", 1, QKV, H100, BF16, 0, True, rt.GLUON_MMA),
    ("nvfp4", "forward", 4, GATE_UP, H100, BF16, 16, True, rt.GLUON_MMA),
    ("nvfp4", "forward", 5, QKV, H100, BF16, 0, True, rt.GLUON_MMA),
    ("nvfp4", "forward", 5, GATE_UP, H100, BF16, 0, True, rt.GLUON_WGMMA_XP),
    ("nvfp4", "forward", 8, O72, H100, BF16, 0, True, rt.GLUON_MMA),  # 67M elements: below the 100M bar
    ("nvfp4", "forward", 9, QKV, H100, BF16, 0, True, rt.GLUON_WGMMA),  # < 32M elements: x staged
    ("nvfp4", "forward", 9, O72, H100, BF16, 0, True, rt.GLUON_WGMMA_XP),
    ("nvfp4", "forward", 64, QKV, H100, BF16, 0, True, rt.GLUON_WGMMA),
    ("nvfp4", "forward", 65, QKV, H100, BF16, 0, True, rt.GLUON_WGMMA_XP),  # above 64 rows x always permuted
    ("nvfp4", "forward", 128, QKV, H100, BF16, 0, True, rt.GLUON_WGMMA_XP),
    ("nvfp4", "forward", 129, QKV, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "forward", 255, GATE_UP, H100, BF16, 0, True, rt.GLUON_WGMMA_XP),
    # the warp-specialized kernel: 256-1024 rows, weights >= 8192 rows and >= 2^27 elements
    ("nvfp4", "forward", 256, GATE_UP, H100, BF16, 16, True, rt.GLUON_WGMMA_WS),
    ("nvfp4", "forward", 1024, DOWN72, H100, BF16, 0, True, rt.GLUON_WGMMA_WS),
    ("nvfp4", "forward", 1025, GATE_UP, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "forward", 512, DOWN, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),  # 3584 rows: not wide enough
    ("nvfp4", "forward", 512, O72, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),  # 67M elements: too small
    ("nvfp4", "forward", 512, GATE_UP, H100, FP16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "forward", 512, GATE_UP, B200, BF16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "forward", 4096, GATE_UP, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),
    # other sm_80+ GPUs: mma.sync up to 64 rows, then the Triton kernels
    ("nvfp4", "forward", 1, QKV, A100, BF16, 0, True, rt.GLUON_MMA),
    ("nvfp4", "forward", 64, GATE_UP, B200, BF16, 0, True, rt.GLUON_MMA),
    ("nvfp4", "forward", 65, GATE_UP, B200, BF16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "forward", 17, QKV, (12, 0), BF16, 0, True, rt.GLUON_MMA),
    ("nvfp4", "forward", 100, QKV, (8, 9), BF16, 0, True, rt.TRITON_DEQUANTIZE),
    # the Gluon kernels decline: the GEMV at one row, then tl.dot (<= 16 rows, <= 64 for big weights)
    ("nvfp4", "forward", 1, QKV, H100, FP16, 0, True, rt.TRITON_GEMV),
    ("nvfp4", "forward", 1, QKV, H100, BF16, 0, False, rt.TRITON_GEMV),  # global scale <= 128
    ("nvfp4", "forward", 1, SMOL, H100, BF16, 0, True, rt.TRITON_GEMV),  # K % 128 != 0
    ("nvfp4", "forward", 1, QKV, (7, 5), BF16, 0, True, rt.TRITON_GEMV),  # pre-Ampere
    ("nvfp4", "forward", 2, SMOL, A100, BF16, 0, True, rt.TRITON_DOT),
    ("nvfp4", "forward", 16, QKV, H100, FP16, 0, True, rt.TRITON_DOT),
    ("nvfp4", "forward", 17, QKV, H100, FP16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "forward", 64, GATE_UP, H100, FP16, 0, True, rt.TRITON_DOT),
    ("nvfp4", "forward", 65, GATE_UP, H100, FP16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "forward", 0, QKV, H100, BF16, 0, True, rt.TRITON_DOT),  # empty input
    # NVFP4 input gradient: the Gluon kernel on sm_90 at 65-256 rows for weights >= 2^26 elements (to 512 rows
    # from 192M elements); else tl.dot or dequantize + cuBLAS (MXFP4 only these)
    ("nvfp4", "grad_input", 1, QKV, H100, BF16, 0, True, rt.TRITON_DOT),
    ("nvfp4", "grad_input", 64, GATE_UP, H100, BF16, 0, True, rt.TRITON_DOT),
    ("nvfp4", "grad_input", 65, GATE_UP, H100, BF16, 0, True, rt.GLUON_GRAD_INPUT),
    ("nvfp4", "grad_input", 256, DOWN, H100, BF16, 0, True, rt.GLUON_GRAD_INPUT),
    ("nvfp4", "grad_input", 257, DOWN, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),  # 68M elements: <= 256 rows
    ("nvfp4", "grad_input", 512, DOWN72, H100, BF16, 0, True, rt.GLUON_GRAD_INPUT),
    ("nvfp4", "grad_input", 257, GATE_UP, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),  # 136M: <= 256 rows
    ("nvfp4", "grad_input", 513, DOWN72, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "grad_input", 64, QKV, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),  # 16.5M elements: too small
    ("nvfp4", "grad_input", 256, O72, H100, BF16, 0, True, rt.GLUON_GRAD_INPUT),  # 67M elements
    ("nvfp4", "grad_input", 256, GATE_UP, H100, FP16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "grad_input", 256, GATE_UP, H100, BF16, 0, False, rt.TRITON_DEQUANTIZE),  # global scale <= 128
    ("nvfp4", "grad_input", 256, GATE_UP, B200, BF16, 0, True, rt.TRITON_DEQUANTIZE),
    ("nvfp4", "grad_input", 256, (37890, 3584), H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),  # N % 8: no TMA
    ("mxfp4", "forward", 1, QKV, H100, BF16, 0, True, rt.TRITON_DOT),
    ("mxfp4", "forward", 17, QKV, H100, BF16, 0, True, rt.TRITON_DEQUANTIZE),
    ("mxfp4", "grad_input", 4096, GATE_UP, A100, FP16, 0, True, rt.TRITON_DEQUANTIZE),
    # no kernel: CPU / Triton off, fp32, formats without kernels
    ("nvfp4", "forward", 1, QKV, None, BF16, 0, True, rt.TORCH_DEQUANTIZE),
    ("nvfp4", "forward", 1, QKV, H100, FP32, 0, True, rt.TORCH_DEQUANTIZE),
    ("mxfp4", "grad_input", 8, QKV, None, FP32, 0, True, rt.TORCH_DEQUANTIZE),
    ("nf4", "forward", 1, QKV, H100, BF16, 0, True, rt.TORCH_DEQUANTIZE),
    # bf16 weights: the Gluon bf16 kernel for 1-32 bf16 rows on sm_80+, LoRA rank sum <= 128
    ("bf16", "forward", 1, QKV, H100, BF16, 0, True, rt.GLUON_BF16),
    ("bf16", "forward", 32, GATE_UP, A100, BF16, 128, True, rt.GLUON_BF16),
    ("bf16", "forward", 33, QKV, H100, BF16, 0, True, rt.TORCH_LINEAR),
    ("bf16", "forward", 8, QKV, H100, BF16, 256, True, rt.TORCH_LINEAR),
    ("bf16", "forward", 8, QKV, H100, FP16, 0, True, rt.TORCH_LINEAR),
    ("bf16", "forward", 8, QKV, (7, 5), BF16, 0, True, rt.TORCH_LINEAR),
    ("bf16", "forward", 8, QKV, None, BF16, 0, True, rt.TORCH_LINEAR),
]


@pytest.mark.parametrize("fmt,op,m,nk,cap,dtype,lora_r,fits,want", TABLE)
def test_route_table(fmt, op, m, nk, cap, dtype, lora_r, fits, want):
    n, k = nk
    assert rt.route(fmt, m, n, k, cap, op=op, dtype=dtype, lora_r=lora_r, step_fits=fits) == want


def test_lora_rides_in_the_gluon_kernels_up_to_the_epilogue_width():
    assert rt.lora_in_kernel(rt.GLUON_MMA, 128) and rt.lora_in_kernel(rt.GLUON_BF16, 16)
    assert not rt.lora_in_kernel(rt.GLUON_WGMMA_XP, 256)  # wider: one addmm after the launch
    assert not rt.lora_in_kernel(rt.TRITON_DOT, 16) and not rt.lora_in_kernel(rt.GLUON_MMA, 0)
    # the rank does not change the NVFP4 backend (the kernel runs without it, one addmm adds it)
    assert rt.route("nvfp4", 8, *QKV, H100, lora_r=256) == rt.GLUON_MMA


def test_unavailable_backends_are_routed_around():
    wg = frozenset({rt.GLUON_WGMMA, rt.GLUON_WGMMA_XP})
    assert rt.route("nvfp4", 16, *GATE_UP, H100, unavailable=wg) == rt.GLUON_MMA
    assert rt.route("nvfp4", 100, *GATE_UP, H100, unavailable=wg) == rt.TRITON_DEQUANTIZE
    assert rt.route("nvfp4", 1, *QKV, H100, unavailable=frozenset(rt.GLUON_NVFP4)) == rt.TRITON_GEMV
    ws = frozenset({rt.GLUON_WGMMA_WS})
    assert rt.route("nvfp4", 256, *GATE_UP, H100, unavailable=ws) == rt.GLUON_WGMMA_XP
    assert rt.route("nvfp4", 512, *GATE_UP, H100, unavailable=ws) == rt.TRITON_DEQUANTIZE
    assert rt.route("bf16", 1, *QKV, H100, unavailable=frozenset({rt.GLUON_BF16})) == rt.TORCH_LINEAR
    gi = frozenset({rt.GLUON_GRAD_INPUT})
    assert rt.route("nvfp4", 65, *GATE_UP, H100, op="grad_input", unavailable=gi) == rt.TRITON_DEQUANTIZE
    assert rt.route("nvfp4", 256, *GATE_UP, H100, op="grad_input", unavailable=gi) == rt.TRITON_DEQUANTIZE


def test_grad_input_without_a_temporary_takes_the_kernel_wherever_W_would_be_dequantized():
    with rt.kernel_policy(grad_input_no_temporary=True):
        for m in (65, 513, 8192):
            for nk in (QKV, GATE_UP):
                assert rt.route("nvfp4", m, *nk, H100, op="grad_input") == rt.GLUON_GRAD_INPUT, (m, nk)
        assert rt.route("nvfp4", 16, *QKV, H100, op="grad_input") == rt.TRITON_DOT  # no temporary there anyway
        assert rt.route("nvfp4", 64, *GATE_UP, H100, op="grad_input") == rt.TRITON_DOT
        assert rt.route("nvfp4", 4096, *GATE_UP, A100, op="grad_input") == rt.TRITON_DEQUANTIZE  # no kernel
        assert rt.route("nvfp4", 4096, *GATE_UP, H100, op="forward") == rt.TRITON_DEQUANTIZE  # backward only


def test_policy_is_scoped_and_overrides_the_rule():
    assert rt.current_policy() == rt.KernelPolicy()
    with rt.kernel_policy(fused_max_m=32, disabled={rt.GLUON_MMA}) as p:
        assert p.fused_max_m == 32 and rt.current_policy() is p
        assert rt.route("nvfp4", 1, *QKV, A100) == rt.TRITON_GEMV
        assert rt.route("nvfp4", 32, *QKV, A100, dtype=FP16) == rt.TRITON_DOT
        with rt.kernel_policy(permute_x=False):
            assert rt.route("nvfp4", 100, *GATE_UP, H100) == rt.GLUON_WGMMA
            assert rt.current_policy().fused_max_m == 32  # nested scopes build on the outer one
    assert rt.current_policy() == rt.KernelPolicy()
    assert rt.route("nvfp4", 32, *QKV, A100, dtype=FP16) == rt.TRITON_DEQUANTIZE
    assert rt.route("nvfp4", 1, *QKV, A100, policy=rt.KernelPolicy(gemv_max_m=0)) == rt.GLUON_MMA


def test_triton_switch_routes_cuda_inputs_to_the_reference(monkeypatch):
    x = torch.zeros(2, 8)  # a CPU tensor never takes a kernel
    assert rt.kernel_capability(x) is None
    monkeypatch.setenv("QERL_DISABLE_TRITON", "1")
    assert not rt.triton_enabled()
    with rt.kernel_policy(triton=True):
        assert rt.triton_enabled() == rt.triton_available()
    monkeypatch.delenv("QERL_DISABLE_TRITON")
    with rt.kernel_policy(triton=False):
        assert not rt.triton_enabled()


def test_a_warp_specialized_backend_that_cannot_run_is_marked_and_routed_around(monkeypatch):
    """`nvfp4_matmul._call_or_mark`: a kernel module that does not import, or a launch that fails to build, marks
    its backend unavailable (with a warning) and returns None; bad arguments are the caller's error."""
    from qerl.kernels import nvfp4_matmul

    monkeypatch.setattr(rt, "_UNAVAILABLE", set())
    with pytest.warns(RuntimeWarning, match="kernel X unavailable here .ModuleNotFoundError"):
        assert nvfp4_matmul._call_or_mark("no_such_kernel_module", "kernel X", rt.GLUON_GRAD_INPUT, None) is None
    assert rt.unavailable() == {rt.GLUON_GRAD_INPUT}
    assert rt.route("nvfp4", 256, *GATE_UP, H100, op="grad_input", unavailable=rt.unavailable()) == \
        rt.TRITON_DEQUANTIZE

    def fails_to_build(mod):
        raise RuntimeError("out of shared memory")

    with pytest.warns(RuntimeWarning, match="out of shared memory"):
        assert nvfp4_matmul._call_or_mark("route", "kernel Y", rt.GLUON_WGMMA_WS, fails_to_build) is None
    assert rt.unavailable() == {rt.GLUON_GRAD_INPUT, rt.GLUON_WGMMA_WS}

    def bad_arguments(mod):
        raise ValueError("K % 32")

    with pytest.raises(ValueError, match="K % 32"):
        nvfp4_matmul._call_or_mark("route", "kernel Z", rt.GLUON_MMA, bad_arguments)
    assert rt.GLUON_MMA not in rt.unavailable()


def test_small_weights_above_64_rows_take_64_row_tiles_x_staged_and_few_k_splits():
    """The wgmma form above swap_max_m rows at a 1.5B model's shapes (docs/benchmarks.md, "Small weights at rollout
    rows"; `git show 8441d0e:benchmarks/small_weight_tiles.py`): x staged for q/k/v and o (pre-permuted from 8M
    elements: gate/up, down), 64-row activation tiles under big_weight (128 above), and above 32 rows no K split
    shorter than wide_m_min_k_tiles tiles; the policy restores the earlier rule."""
    pytest.importorskip("triton")
    from qerl.kernels.gluon import nvfp4 as gk

    def plan(m, n, k):
        cfg, waves = gk.pick_config_wgmma(m, n, k)
        floor = rt.current_policy().wide_m_min_k_tiles if m > 32 else 1
        return cfg[1], gk.split_for(m, n, k, cfg, 132, waves, floor), rt.route("nvfp4", m, n, k, H100)

    assert plan(128, 2048, 1536) == (64, (4, 3), rt.GLUON_WGMMA)  # q/k/v: 12 K tiles in 4 splits of 3
    assert plan(64, 1536, 1536) == (64, (4, 3), rt.GLUON_WGMMA)  # o at 64 rows: was 12 splits of one tile
    assert plan(96, 17920, 1536)[::2] == (64, rt.GLUON_WGMMA_XP)  # gate/up
    assert plan(128, 8192, 8192) == (128, (3, 22), rt.GLUON_WGMMA_XP)  # 64M elements: a big weight
    assert plan(1, 2048, 1536)[1] == (6, 1)  # one row: partials are tiny, every K tile its own split
    with rt.kernel_policy(wide_m_tile=128, permute_x_min_weight=0, wide_m_min_k_tiles=1):
        assert plan(128, 2048, 1536) == (128, (6, 2), rt.GLUON_WGMMA_XP)
        assert plan(64, 1536, 1536)[1] == (12, 1)
    assert gk.split_for(1, 64, 1024, (64, 8, 64, 16, 3), 132, 4.0, min_tiles_per_split=5) == (1, 8)


def test_decode_rows_split_k_only_where_the_output_tiles_leave_sms_idle():
    """1-8 rows on 132 SMs (`benchmarks/fp4_gemv_bound.py --splits` on an H200): a 7B model's q/k/v (72 tiles of 64
    rows) in 7 splits of 2 K tiles, its down projection in 10; a gate/up of >= 264 tiles not split at all."""
    pytest.importorskip("triton")
    from qerl.kernels.gluon import nvfp4 as gk

    def splits(m, n, k):
        cfg, waves = gk.pick_config(m, n, k)
        return gk.split_for(m, n, k, cfg, 132, waves)

    assert splits(1, 4608, 3584) == (7, 2) and splits(8, 4608, 3584) == (7, 2)
    assert splits(1, 3584, 18944) == (10, 8)
    assert splits(8, 17920, 1536) == (1, 6) and splits(1, 37888, 3584) == (1, 14)


def test_a_kept_dense_copy_is_read_where_the_4bit_kernels_lose():
    from qerl.kernels.route import KernelPolicy, reads_dense_copy

    p = KernelPolicy(dense_min_m=64)  # any threshold: the rule, not the tuned value
    assert not reads_dense_copy("nvfp4", 1, True, p) and not reads_dense_copy("mxfp4", 63, True, p)
    assert reads_dense_copy("nvfp4", 64, True, p) and reads_dense_copy("nvfp4", 4096, True, p)
    # no 4-bit GPU kernel to prefer: the copy at every row count
    assert reads_dense_copy("nvfp4", 1, False, p) and reads_dense_copy("nf4", 1, True, p)
    assert KernelPolicy().dense_min_m >= 1  # from kernels/tuning
