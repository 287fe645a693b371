"""The engine's fused Triton kernels (residual add + RMSNorm, RoPE, SiLU * up, decode RoPE + KV-cache write)
against the eager torch code they replace.

Reference: HF's own `Qwen2RMSNorm` module, the rotate-half formula (`fused_ops.rope_reference`), F.silu and
an index_copy_ into the cache slot. The kernels round where torch rounds, so the residual sum, RoPE, the cache
writes and silu * up must match bit for bit; the norm may differ only through the fp32 summation order of
its mean (a last-bit difference in a few elements). Run on the CPU through the Triton interpreter
(subprocess, as in test_kernels_triton) and directly on a GPU, which is the real check of silu: its exp is
libdevice's there, the same as torch's CUDA kernel, and float64-rounded exp in the interpreter.
Outputs are filled with NaN first (`workspace.poisoned_outputs`), so an unwritten element fails.
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from kernel_testing import poisoned, require_cuda, run_interpreter_suite

from qerl.kernels.workspace import capture_graph, poisoned_outputs

# (rows, D) for the norm: odd D, a power of two, SmolLM2's 576, Qwen2.5-7B's 3584
NORM_SHAPES = [(1, 24), (3, 100), (5, 576), (2, 3584)]
# (B, L, heads, hd): odd head counts, hd whose half is not a power of two (80 -> 40)
ROPE_SHAPES = [(1, 1, 3, 64), (2, 5, 7, 80), (3, 1, 28, 128), (1, 4, 4, 32)]
# (M, I) for silu * up: odd I, one past the kernel's 1024-column block, Qwen2.5-0.5B's 4864
SILU_SHAPES = [(1, 37), (3, 1025), (2, 4864)]
# (B, H, KV, hd, max_len, slot): odd head counts, GQA and MHA, slot first / middle / last
ROPE_STORE_CASES = [(1, 3, 1, 64, 5, 0), (2, 7, 1, 128, 9, 4), (3, 5, 5, 64, 6, 5), (2, 14, 2, 128, 17, 16)]


def _rms_module(d: int, eps: float, dtype, device, gen):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(d, eps=eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=gen).to(dtype) * 0.5 + 1)
    return norm


@poisoned
def check_norm(device: str, dtype=torch.bfloat16, seed: int = 0) -> list[str]:
    from qerl.kernels.triton.fused_ops import add_rms_norm

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
    from qerl.kernels.triton.fused_ops import rope_

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
            diff = (out.float() - ref.float()).abs().max().item()
            fails.append(f"rope {device} {dtype} {(B, L, H, hd)}: max diff {diff:.3g}")
    return fails


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (silu(-inf) is NaN in torch too)."""
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _silu_inputs(M: int, I: int, dtype, gen, batch_dims: bool) -> torch.Tensor:
    """gate | up [M, 2I] (or [M, 1, 2I]): ordinary values, zeros, large positive and negative ones."""
    big = 6e4 if dtype == torch.float16 else 1e30
    gu = torch.randn(M, 2 * I, generator=gen) * 4
    gu[0, : I // 3] *= 1e3  # silu saturates: g and -0
    gu[0, I // 3: I // 2] = 0
    gu[-1, :3] = torch.tensor([big, -big, -120.0])  # exp(-g) overflows to inf for the last two
    gu[-1, I: I + 3] = big  # products that overflow to inf (fp16)
    gu = gu.to(dtype)
    return gu[:, None] if batch_dims else gu


@poisoned
def check_silu_mul(device: str, dtype=torch.bfloat16, seed: int = 6) -> list[str]:
    """silu_mul on column slices of one [M, 2I] tensor, and on every finite and infinite 16-bit gate value,
    against F.silu(gate) * up on the same device."""
    from qerl.kernels.triton.fused_ops import silu_mul

    fails = []
    gen = torch.Generator().manual_seed(seed)
    for i, (M, I) in enumerate(SILU_SHAPES):
        gu = _silu_inputs(M, I, dtype, gen, batch_dims=i == 1).to(device)
        gate, up = gu[..., :I], gu[..., I:]
        out = silu_mul(gate, up)
        ref = F.silu(gate) * up
        if not out.is_contiguous() or not _same_bits(out, ref):
            bad = (out != ref).sum().item()
            fails.append(f"silu_mul {device} {dtype} {(M, I)}: {bad} elements differ, contiguous={out.is_contiguous()}")
    # all 2^16 bit patterns but NaN as gate, up = 1 (exact), each with its own rounding of silu
    g = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    keep = ~torch.isnan(g)
    if device == "cpu" and dtype == torch.bfloat16:
        # the interpreter converts bf16 subnormals to and from fp32 wrongly (Triton 3.9 `_convert_float`):
        # no subnormal gates, nor gates whose silu (~ g / 2 near 0) is subnormal
        keep &= (g == 0) | (g.float().abs() >= 2 * torch.finfo(torch.float32).tiny)
    g = g[keep].to(device)
    out = silu_mul(g, torch.ones_like(g))
    if not _same_bits(out, F.silu(g)):
        bad = ((out != F.silu(g)) & ~torch.isnan(F.silu(g))).sum().item()
        fails.append(f"silu_mul {device} {dtype}: silu differs from torch for {bad} of {g.numel()} gate values")
    return fails


def _rope_store_inputs(B, H, KV, hd, max_len, dtype, device, gen):
    """q, k, v as head views of column slices of one [B, 1, (H + 2 KV) * hd] tensor, cos/sin [B, 1, hd],
    caches [B, KV, max_len, hd] full of random values (so an overwritten slot shows)."""
    qkv = torch.randn(B, 1, (H + 2 * KV) * hd, generator=gen).to(dtype).to(device)
    q = qkv[..., : H * hd].view(B, 1, H, hd)
    k = qkv[..., H * hd: (H + KV) * hd].view(B, 1, KV, hd)
    v = qkv[..., (H + KV) * hd:].view(B, 1, KV, hd)
    ang = torch.rand(B, 1, hd // 2, generator=gen) * 100
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
    caches = [torch.randn(B, KV, max_len, hd, generator=gen).to(dtype).to(device) for _ in range(2)]
    return q, k, v, cos, sin, *caches


@poisoned
def check_rope_store(device: str, dtype=torch.bfloat16, seed: int = 7, cases=ROPE_STORE_CASES) -> list[str]:
    """rope_store_decode: the returned q, and the whole caches (slot written, every other slot untouched),
    equal to rope_reference + index_copy_; q, k, v unchanged."""
    from qerl.kernels.fused_ops import rope_reference
    from qerl.kernels.triton.fused_ops import rope_store_decode

    fails = []
    gen = torch.Generator().manual_seed(seed)
    for B, H, KV, hd, max_len, slot in cases:
        q, k, v, cos, sin, kc, vc = _rope_store_inputs(B, H, KV, hd, max_len, dtype, device, gen)
        inputs = [t.clone() for t in (q, k, v)]
        ref_k, ref_v = kc.clone(), vc.clone()
        ref_k[:, :, slot] = rope_reference(k, cos, sin)[:, 0]
        ref_v[:, :, slot] = v[:, 0]
        out = rope_store_decode(q, k, v, cos, sin, kc, vc, torch.tensor(slot, device=device))
        tag = f"rope_store {device} {dtype} {(B, H, KV, hd, max_len, slot)}"
        if not out.is_contiguous() or not torch.equal(out, rope_reference(q, cos, sin)):
            fails.append(f"{tag}: rotated q differs (or is not contiguous)")
        if not torch.equal(kc, ref_k) or not torch.equal(vc, ref_v):
            bad_k, bad_v = (kc != ref_k).sum().item(), (vc != ref_v).sum().item()
            fails.append(f"{tag}: cache differs at {bad_k} k, {bad_v} v elements")
        if not all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v))):
            fails.append(f"{tag}: an input was written")
    # a slot per row (the engine's rows decode at their own slots): row b writes slot[b] only, with the
    # public entry (Triton on CUDA, the torch path elsewhere) against the same reference
    from qerl.kernels.fused_ops import rope_qk_store

    for B, H, KV, hd, max_len, _ in cases:
        q, k, v, cos, sin, kc, vc = _rope_store_inputs(B, H, KV, hd, max_len, dtype, device, gen)
        slots = torch.randint(0, max_len, (B,), generator=gen)
        ref_k, ref_v = kc.clone(), vc.clone()
        for b, sl in enumerate(slots.tolist()):
            ref_k[b, :, sl] = rope_reference(k, cos, sin)[b, 0]
            ref_v[b, :, sl] = v[b, 0]
        for fn in (rope_store_decode, rope_qk_store):
            kk, vv = kc.clone(), vc.clone()
            out = fn(q, k, v, cos, sin, kk, vv, slots.to(device))
            if not torch.equal(out, rope_reference(q, cos, sin)) or not torch.equal(kk, ref_k) \
                    or not torch.equal(vv, ref_v):
                fails.append(f"rope_store {device} {dtype} {(B, H, KV, hd, max_len)} slots {slots.tolist()} "
                             f"({fn.__name__}): differs from the per-row reference")
    # a slot outside the cache writes nothing (documented: a graph replay cannot raise as index_copy_ does)
    B, H, KV, hd, max_len, _ = cases[0]
    q, k, v, cos, sin, kc, vc = _rope_store_inputs(B, H, KV, hd, max_len, dtype, device, gen)
    before = kc.clone(), vc.clone()
    for slot in (-1, max_len):
        rope_store_decode(q, k, v, cos, sin, kc, vc, torch.tensor(slot, device=device))
    if not torch.equal(kc, before[0]) or not torch.equal(vc, before[1]):
        fails.append(f"rope_store {device} {dtype}: an out-of-range slot wrote into the cache")
    return fails


# (rows, D, R) for the norm + LoRA A product: odd D and R, one R block or several, Qwen2.5-7B's D with q/k/v's R
NORM_LORA_A_SHAPES = [(1, 24, 5), (3, 100, 48), (5, 576, 16), (2, 3584, 48)]


@poisoned
def check_norm_lora_a(device: str, dtype=torch.bfloat16, seed: int = 11) -> list[str]:
    """add_rms_norm_lora_a: the residual sum and the norm as add_rms_norm (bit for bit: the same kernel body),
    and xa = out @ a^T of the returned out, accumulated in fp32 and rounded once."""
    from qerl.kernels.triton.fused_ops import add_rms_norm, add_rms_norm_lora_a

    fails = []
    gen = torch.Generator().manual_seed(seed)
    for rows, d, r in NORM_LORA_A_SHAPES:
        for with_delta in (False, True):
            norm = _rms_module(d, 1e-6, dtype, device, gen)
            h = (torch.randn(rows, d, generator=gen) * 3).to(dtype)
            h[0, : d // 2] *= 1e3
            if rows > 1:
                h[1] = 0  # an all-zero row
            delta = (torch.randn(rows, d, generator=gen)).to(dtype) if with_delta else None
            a = (torch.randn(r, d, generator=gen) / d ** 0.5).to(dtype)
            h, a = h.to(device), a.to(device)
            delta = None if delta is None else delta.to(device)
            s, out, xa = add_rms_norm_lora_a(h, delta, norm.weight, norm.variance_epsilon, a)
            ref_s, ref_out = add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
            tag = f"norm+lora_a {device} {dtype} rows={rows} d={d} r={r} delta={with_delta}"
            if not (torch.isfinite(out).all() and torch.isfinite(xa).all() and torch.isfinite(s).all()):
                fails.append(f"{tag}: non-finite output")
                continue
            if not torch.equal(s, ref_s) or not torch.equal(out, ref_out):
                fails.append(f"{tag}: sum or norm differs from add_rms_norm")
            ref = out.double() @ a.double().t()
            scale = out.double().abs() @ a.double().abs().t()  # bound of the fp32 summation-order error
            err = ((xa.double() - ref).abs() - torch.finfo(dtype).eps * ref.abs()) / scale.clamp_min(1e-30)
            if tuple(xa.shape) != (rows, r) or xa.dtype != dtype or err.max().item() > 1e-5:
                fails.append(f"{tag}: xa off by {err.max().item():.2e} of |out| |a| (shape {tuple(xa.shape)})")
    return fails


def check_silu_mul_lora_a(device: str, dtype=torch.bfloat16, seed: int = 14) -> list[str]:
    """silu_mul_lora_a: the activation bit for bit `silu_mul`'s (also on the inf / NaN inputs), h = act @ a^T within
    the fp32 summation-order bound of the float64 product of the stored act, two calls equal, the row counters left
    at zero; I one past the block and odd, R not a power of two, strided gate / up, 1-3 rows; and an R of 100, whose
    19 parts the last program loads in two rounds of 16."""
    from qerl.kernels import workspace
    from qerl.kernels.triton.fused_ops import silu_mul, silu_mul_lora_a

    fails = []
    gen = torch.Generator().manual_seed(seed)
    for (M, I), r in [*zip(SILU_SHAPES, (8, 24, 16)), ((2, 4864), 100)]:
        for extreme in (False, True):
            gu = _silu_inputs(M, I, dtype, gen, batch_dims=False).to(device) if extreme else \
                (torch.randn(M, 2 * I, generator=gen) * 2).to(dtype).to(device)
            gate, up = gu[..., :I], gu[..., I:]
            a = (torch.randn(r, I, generator=gen) * 0.05).to(dtype).to(device)
            tag = f"silu_mul_lora_a {device} {dtype} {(M, I)} r={r} extreme={extreme}"
            with poisoned_outputs():
                (act, h), (act2, h2) = silu_mul_lora_a(gate, up, a), silu_mul_lora_a(gate, up, a)
            if not _same_bits(act, silu_mul(gate, up)) or not _same_bits(act2, act) or not _same_bits(h2, h):
                fails.append(f"{tag}: the activation differs from silu_mul's, or two calls differ")
            counters = [t[1] for key, t in workspace._PERSISTENT.items() if key[0] == "silu_mul_lora_a"]
            if not counters or any(int(c.abs().sum()) for c in counters):
                fails.append(f"{tag}: a row counter was not left at zero")
            if extreme:
                continue  # inf products make h inf / NaN: only the activation is checked there
            ref = act.double() @ a.double().t()
            scale = act.double().abs() @ a.double().abs().t()
            err = ((h.double() - ref).abs() - torch.finfo(dtype).eps * ref.abs()) / scale.clamp_min(1e-30)
            if tuple(h.shape) != (M, r) or h.dtype != dtype or not torch.isfinite(h).all() or err.max() > 1e-5:
                fails.append(f"{tag}: h off by {err.max().item():.2e} of |act| |a| (shape {tuple(h.shape)})")
    return fails


def interpreter_suite() -> list[str]:
    return check_norm("cpu") + check_norm("cpu", torch.float32, seed=3) + check_rope("cpu") + \
        check_rope("cpu", torch.float16, seed=4) + check_silu_mul("cpu") + check_silu_mul("cpu", torch.float16) + \
        check_rope_store("cpu") + check_rope_store("cpu", torch.float16, seed=8, cases=ROPE_STORE_CASES[1:3]) + \
        check_norm_lora_a("cpu") + check_norm_lora_a("cpu", torch.float16, seed=12) + check_silu_mul_lora_a("cpu")


def test_interpreter():
    fails = run_interpreter_suite("test_fused_ops", timeout=600)
    assert not fails, "\n".join(fails)


def test_cpu_path_is_the_eager_reference(monkeypatch):
    """Off CUDA, the fused ops are exactly the eager code (the Triton module cannot even be imported)."""
    from transformers.activations import ACT2FN

    from qerl.kernels.fused_ops import add_norm, rope_qk, rope_qk_store, rope_reference, silu_mul

    monkeypatch.setitem(sys.modules, "qerl.kernels.triton.fused_ops", None)  # importing it raises
    gen = torch.Generator().manual_seed(5)
    norm = _rms_module(48, 1e-5, torch.bfloat16, "cpu", gen)
    h, d = torch.randn(2, 3, 48).bfloat16(), torch.randn(2, 3, 48).bfloat16()
    s, out = add_norm(h, d, norm)
    assert torch.equal(s, h + d) and torch.equal(out, norm(h + d))
    q, k = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16)
    cos, sin = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    rq, rk = rope_qk(q, k, cos, sin)
    assert torch.equal(rq, rope_reference(q, cos, sin)) and torch.equal(rk, rope_reference(k, cos, sin))

    gu = torch.randn(3, 2, 2 * 24).bfloat16()
    gate, up = gu[..., :24], gu[..., 24:]
    for act in (None, ACT2FN["silu"], torch.nn.SiLU()):
        assert torch.equal(silu_mul(gate, up, act), F.silu(gate) * up)
    assert torch.equal(silu_mul(gate, up, ACT2FN["gelu"]), ACT2FN["gelu"](gate) * up)

    q, k, v, cos, sin, kc, vc = _rope_store_inputs(2, 3, 1, 16, 4, torch.bfloat16, "cpu", gen)
    ref_k, ref_v = kc.clone(), vc.clone()
    slot = torch.tensor(2)
    ref_k.index_copy_(2, slot.view(1), rope_reference(k, cos, sin).transpose(1, 2))
    ref_v.index_copy_(2, slot.view(1), v.transpose(1, 2))
    assert torch.equal(rope_qk_store(q, k, v, cos, sin, kc, vc, slot), rope_reference(q, cos, sin))
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu(dtype):
    require_cuda()
    fails = check_norm("cuda", dtype) + check_rope("cuda", dtype) + check_silu_mul("cuda", dtype) + \
        check_rope_store("cuda", dtype) + check_norm_lora_a("cuda", dtype) + check_silu_mul_lora_a("cuda", dtype)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_gpu_dispatch_and_graph_replay(monkeypatch):
    """On CUDA the public ops take the Triton path with the engine's arguments (HF's act_fn, column slices),
    with the eager result, and rope_qk_store captured in a CUDA graph writes the slot each replay's slot
    tensor holds."""
    require_cuda()
    from transformers.activations import ACT2FN

    from qerl.kernels.triton import fused_ops as triton_fused_ops
    from qerl.kernels.fused_ops import rope_qk_store, rope_reference, silu_mul

    calls = []
    for name in ("silu_mul", "rope_store_decode"):
        fn = getattr(triton_fused_ops, name)
        monkeypatch.setattr(triton_fused_ops, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    gen = torch.Generator().manual_seed(9)
    gu = torch.randn(4, 2 * 96, generator=gen).bfloat16().cuda()
    gate, up = gu[:, :96], gu[:, 96:]
    assert torch.equal(silu_mul(gate, up, ACT2FN["silu"]), F.silu(gate) * up)
    assert calls == ["silu_mul"]

    B, H, KV, hd, max_len = 2, 7, 1, 64, 8
    q, k, v, cos, sin, kc, vc = _rope_store_inputs(B, H, KV, hd, max_len, torch.bfloat16, "cuda", gen)
    slot = torch.zeros((), dtype=torch.int64, device="cuda")
    # the warm-up call writes slot 0 for real; ref_k/ref_v start from that
    graph, rq = capture_graph(lambda: rope_qk_store(q, k, v, cos, sin, kc, vc, slot), warmups=1)
    ref_k, ref_v = kc.clone(), vc.clone()
    for s in (3, 0, max_len - 1):
        slot.fill_(s)
        graph.replay()
        ref_k[:, :, s] = rope_reference(k, cos, sin)[:, 0]
        ref_v[:, :, s] = v[:, 0]
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), f"slot {s}"
        assert torch.equal(rq, rope_reference(q, cos, sin))
    assert calls == ["silu_mul", "rope_store_decode", "rope_store_decode"]


@pytest.mark.gpu
def test_engine_logits_with_and_without_fused_ops(monkeypatch):
    """Prefill logits of the engine with the fused kernels equal those of its eager-op path within bf16 noise
    (every layer's norms, residual adds and RoPE go through them)."""
    require_cuda()
    from qerl.rollout.engine import RolloutEngine

    from test_rollout_engine import quantize_tiny, tiny_model

    model = quantize_tiny(tiny_model("qwen2"), fmt="bf16").cuda().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(3, model.config.vocab_size, (4, 11), generator=gen)
    prompts = [t[:n].tolist() for t, n in zip(tokens, (11, 9, 6, 11))]  # ragged: right-padded in the prefill
    rows = torch.arange(4).cuda()

    def prefill_logits():
        eng = RolloutEngine(model, max_seq_len=64, kv_block=32, cuda_graphs=False)
        eng._setup(4)
        return eng.prefill(prompts, rows, rows).float()

    from qerl.kernels.route import kernel_policy

    fused = prefill_logits()
    with kernel_policy(triton=False):
        eager = prefill_logits()
    assert torch.isfinite(fused).all()
    scale = eager.abs().max().item()
    torch.testing.assert_close(fused, eager, atol=0.02 * scale, rtol=0)
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.75


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_decode_with_the_norm_launch_doing_lora_a_equals_separate_launches(fmt, monkeypatch):
    """The engine's graph-replayed decode with each norm launch also computing the next group's LoRA A product
    (`fused_ops.add_norm_lora_a`) against the same engine with a separate LoRA A launch: the same greedy tokens
    and log-probs within bf16 noise (the two sum the product in a different fp32 order)."""
    require_cuda()
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    from test_rollout_engine import prompts_of, quantize_tiny
    from tiny import tiny_model

    model = quantize_tiny(tiny_model("qwen2", hidden_size=256, intermediate_size=512), fmt=fmt)
    model = model.cuda().to(torch.bfloat16)  # B random: a wrong A product would move the outputs
    from qerl.kernels.triton import fused_ops as triton_fused_ops

    calls = []
    fn = triton_fused_ops.add_rms_norm_lora_a
    monkeypatch.setattr(triton_fused_ops, "add_rms_norm_lora_a", lambda *a: calls.append(1) or fn(*a))
    prompts = prompts_of([5, 9, 3], seed=6)
    greedy = SamplingParams(temperature=0)
    runs = []
    for fuse in (True, False):
        engine = RolloutEngine(model, max_seq_len=64, kv_block=32)
        engine.runner.fuse_norm_lora_a = fuse
        runs.append(engine.generate(prompts, 12, greedy, ignore_eos=True))
        if fuse:
            assert calls, "the fused launch was not taken"
            calls.clear()
    fused, separate = runs
    assert not calls
    assert torch.isfinite(fused.logprobs).all()
    assert torch.equal(fused.completion_ids[:, :4], separate.completion_ids[:, :4])
    torch.testing.assert_close(fused.logprobs[:, :4], separate.logprobs[:, :4], atol=0.05, rtol=0)
