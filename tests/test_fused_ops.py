"""The engine's fused residual-add + RMSNorm and RoPE Triton kernels against the eager torch code they replace.

Reference: HF's own `Qwen2RMSNorm` module and the rotate-half formula (`fused_ops.rope_reference`). The
kernels round where torch rounds, so the residual sum and RoPE must match bit for bit; the norm may differ
only through the fp32 summation order of its mean (a last-bit difference in a few elements). Run on the
CPU through the Triton interpreter (subprocess, as in test_kernels_triton) and directly on a GPU.
Outputs are filled with NaN first (torch.empty is replaced), so an unwritten element fails.
"""

import pytest
import torch

from kernel_testing import require_cuda, run_interpreter_suite

# (rows, D) for the norm: odd D, a power of two, SmolLM2's 576, Qwen2.5-7B's 3584
NORM_SHAPES = [(1, 24), (3, 100), (5, 576), (2, 3584)]
# (B, L, heads, hd): odd head counts, hd whose half is not a power of two (80 -> 40)
ROPE_SHAPES = [(1, 1, 3, 64), (2, 5, 7, 80), (3, 1, 28, 128), (1, 4, 4, 32)]


def _rms_module(d: int, eps: float, dtype, device, gen):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(d, eps=eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=gen).to(dtype) * 0.5 + 1)
    return norm


def check_norm(device: str, dtype=torch.bfloat16, seed: int = 0) -> list[str]:
    from qerl.kernels.triton_fused_ops import add_rms_norm

    fails = []
    gen = torch.Generator().manual_seed(seed)
    for rows, d in NORM_SHAPES:
        for with_delta in (False, True):
            norm = _rms_module(d, 1e-6, dtype, device, gen)
            h = (torch.randn(rows, d, generator=gen) * 3).to(dtype)
            h[0, : d // 2] *= 1e4 if dtype != torch.float16 else 1e3  # huge and ordinary values (fp16 max 65504)
            if rows > 1:
                h[1] = 0  # an all-zero row: rsqrt(eps) times 0
            delta = (torch.randn(rows, d, generator=gen)).to(dtype) if with_delta else None
            h, delta = h.to(device), None if delta is None else delta.to(device)
            s, out = add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
            ref_s = h if delta is None else h + delta
            ref = norm(ref_s)
            tag = f"norm {device} {dtype} rows={rows} d={d} delta={with_delta}"
            if torch.isnan(out).any() or torch.isnan(s).any():
                fails.append(f"{tag}: NaN in output")
                continue
            if not torch.equal(s, ref_s):
                fails.append(f"{tag}: residual sum differs from torch")
            # last-bit differences from the summation order (and rsqrt) only: <= 1 ulp of a 16-bit output,
            # a few ulp of a float32 one (no rounding to hide them; the engine uses 16-bit activations only)
            max_ulp, min_exact = (4.0, 0.0) if dtype == torch.float32 else (1.01, 0.9)
            ulp = ((out.float() - ref.float()).abs() / (ref.float().abs() * torch.finfo(dtype).eps).clamp_min(1e-30))
            exact = (out == ref).float().mean().item()
            if ulp.max().item() > max_ulp or exact < min_exact:
                fails.append(f"{tag}: max {ulp.max().item():.2f} ulp, {100 * exact:.1f}% exact")
    return fails


def check_rope(device: str, dtype=torch.bfloat16, seed: int = 1) -> list[str]:
    from qerl.kernels.fused_ops import rope_reference
    from qerl.kernels.triton_fused_ops import rope_

    fails = []
    gen = torch.Generator().manual_seed(seed)
    for B, L, H, hd in ROPE_SHAPES:
        x = torch.randn(B, L, H, hd, generator=gen).to(dtype).to(device)
        ang = torch.rand(B, L, hd // 2, generator=gen) * 100
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
        ref = rope_reference(x, cos, sin)
        out = rope_(x.clone(), cos, sin)
        if torch.isnan(out).any() or not torch.equal(out, ref):
            fails.append(f"rope {device} {dtype} {(B, L, H, hd)}: max diff {(out.float() - ref.float()).abs().max().item():.3g}")
    return fails


def interpreter_suite() -> list[str]:
    return check_norm("cpu") + check_norm("cpu", torch.float32, seed=3) + check_rope("cpu") + \
        check_rope("cpu", torch.float16, seed=4)


def test_interpreter():
    fails = run_interpreter_suite("test_fused_ops", timeout=600)
    assert not fails, "\n".join(fails)


def test_cpu_path_is_the_eager_reference():
    """Off CUDA, add_norm / rope_qk are exactly the eager code (no Triton involved)."""
    from qerl.kernels.fused_ops import add_norm, rope_qk, rope_reference

    gen = torch.Generator().manual_seed(5)
    norm = _rms_module(48, 1e-5, torch.bfloat16, "cpu", gen)
    h, d = torch.randn(2, 3, 48).bfloat16(), torch.randn(2, 3, 48).bfloat16()
    s, out = add_norm(h, d, norm)
    assert torch.equal(s, h + d) and torch.equal(out, norm(h + d))
    q, k = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16)
    cos, sin = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    rq, rk = rope_qk(q, k, cos, sin)
    assert torch.equal(rq, rope_reference(q, cos, sin)) and torch.equal(rk, rope_reference(k, cos, sin))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu(dtype):
    require_cuda()
    fails = check_norm("cuda", dtype) + check_rope("cuda", dtype)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_engine_logits_with_and_without_fused_ops(monkeypatch):
    """Prefill logits of the engine with the fused kernels equal those of its eager-op path within bf16 noise
    (every layer's norms, residual adds and RoPE go through them)."""
    require_cuda()
    from qerl.rollout.engine import RolloutEngine

    from test_rollout_engine import quantize_tiny, tiny_model

    model = quantize_tiny(tiny_model("qwen2"), fmt="bf16").cuda().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(3, model.config.vocab_size, (4, 11), generator=gen).cuda()
    pad_len = torch.tensor([0, 2, 5, 0]).cuda()

    def prefill_logits():
        eng = RolloutEngine(model, max_seq_len=64, kv_block=32, cuda_graphs=False)
        eng._setup(4)
        return eng.prefill(tokens, pad_len).float()

    fused = prefill_logits()
    monkeypatch.setenv("QERL_DISABLE_TRITON", "1")
    eager = prefill_logits()
    assert torch.isfinite(fused).all()
    scale = eager.abs().max().item()
    torch.testing.assert_close(fused, eager, atol=0.02 * scale, rtol=0)
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.75
