"""The decode-attention Triton kernel against the fp32 torch reference, and the reference against SDPA.

Inputs are 16-bit; the reference is computed from the same values in fp32. Error: max abs difference over
the reference's max abs value, <= 1e-2 (bf16) / 2e-3 (fp16). Every buffer the kernels write is filled with
NaN first (`workspace.poisoned_outputs`), and every cache slot a query must not see (left pads, slots
past the decode slot, slots >= S) holds NaN, so an unwritten element or a leaked key fails. Run on the CPU
through the Triton interpreter (subprocess) and directly on a GPU, where a CUDA-graph replay with new slot
values is checked too.
"""

import pytest
import torch
import torch.nn.functional as F

from kernel_testing import require_cuda, run_interpreter_suite

from qerl.kernels.workspace import capture_graph, poisoned_outputs

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (B, KV, G, hd, S, max_len, block_n, splits): S not a multiple of the chunk, max_len > S, one split (the
# direct path) and several, splits / block_n None = the production choice
CASES = [
    (1, 1, 1, 64, 40, 48, 16, None),
    (2, 2, 7, 128, 77, 96, 16, 3),
    (3, 1, 2, 64, 96, 100, 32, 1),
    (2, 2, 2, 128, 50, 64, 16, 4),
    (3, 2, 3, 64, 150, 160, None, None),  # B * KV >= the interpreter's 4 "SMs": the wide tile, no split
]
GPU_CASES = CASES + [(3, 4, 7, 128, 768, 800, 64, None), (8, 4, 7, 128, 300, 512, 64, None),
                     (2, 1, 8, 64, 1000, 1024, 64, 2), (34, 4, 7, 128, 600, 640, None, None)]  # the wide tile


def _inputs(B, KV, G, hd, max_len, dtype, device, gen, magnitude=1.0):
    H = G * KV
    # q a strided view (as a slice of a wider buffer would be), k/v the full contiguous caches
    q = (torch.randn(B, H, 2 * hd, generator=gen) * magnitude).to(dtype)[..., :hd]
    k = (torch.randn(B, KV, max_len, hd, generator=gen) * magnitude).to(dtype)
    v = torch.randn(B, KV, max_len, hd, generator=gen).to(dtype)
    pads = torch.randint(0, 6, (B,), generator=gen)
    pads[0] = 0
    key_valid = torch.arange(max_len)[None, :] >= pads[:, None]  # left padding, different per row
    return q.to(device), k.to(device), v.to(device), key_valid.to(device)


def _hide_unseen(k, v, key_valid, slot, S):
    """Copies of k, v with NaN in every slot the query must not read."""
    j = torch.arange(k.shape[2], device=k.device)
    seen = key_valid & (j <= slot.reshape(-1, 1)) & (j < S)
    hidden = ~seen[:, None, :, None]
    return k.masked_fill(hidden, float("nan")), v.masked_fill(hidden, float("nan"))


def _error(out, ref) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_kernel(device: str, dtype=torch.bfloat16, seed: int = 0, cases=CASES, public: bool = False) -> list[str]:
    """Kernel vs fp32 reference for each case at slots 0, a middle one and S - 1, plus huge q/k values."""
    from qerl.kernels import triton_decode_attention as tda
    from qerl.kernels.decode_attention import decode_attention, decode_attention_reference

    fails = []
    gen = torch.Generator().manual_seed(seed)
    with poisoned_outputs():
        for i, (B, KV, G, hd, S, max_len, block_n, splits) in enumerate(cases):
            for magnitude in (1.0, 30.0) if i % 2 == 0 else (1.0,):
                q, k, v, key_valid = _inputs(B, KV, G, hd, max_len, dtype, device, gen, magnitude)
                if i == 1:
                    key_valid[-1] = False  # a dummy row: no visible key at any slot
                scale = hd ** -0.5
                for s in (0, S // 2 + 1, S - 1, "per row"):  # per row: each row its own slot, as the engine
                    slot = torch.tensor(s, dtype=torch.int64, device=device) if s != "per row" else \
                        torch.randint(0, S, (B,), generator=gen).to(device)
                    kn, vn = _hide_unseen(k, v, key_valid, slot, S)
                    if public:
                        out = decode_attention(q, kn, vn, key_valid, slot, S, scale)
                    else:
                        out = tda.decode_attention_triton(q, kn, vn, key_valid, slot, S, scale, splits, block_n)
                    ref = decode_attention_reference(q.float(), k.float(), v.float(), key_valid, slot, S, scale)
                    tag = f"{device} {dtype} case={i} mag={magnitude} slot={s}"
                    if out.dtype != dtype or out.shape != ref.shape:
                        fails.append(f"{tag}: got {out.dtype} {tuple(out.shape)}")
                        continue
                    err = _error(out, ref)
                    if err > TOL[dtype]:
                        fails.append(f"{tag}: relative max error {err:.3g}")
                    blind = ~(key_valid[:, :S] & (torch.arange(S, device=device) <= slot.reshape(-1, 1))).any(1)
                    if blind.any() and not (out[blind] == 0).all():
                        fails.append(f"{tag}: a row with no visible key is not all zeros")
    return fails


def check_reference_vs_sdpa(device: str, seed: int = 2) -> list[str]:
    """The fp32 reference equals SDPA with the same bool mask and k/v repeated per query head."""
    from qerl.kernels.decode_attention import decode_attention_reference

    fails = []
    gen = torch.Generator().manual_seed(seed)
    for B, KV, G, hd, S, max_len in [(2, 2, 7, 64, 37, 50), (3, 1, 1, 128, 20, 20), (1, 4, 2, 32, 9, 16)]:
        q, k, v, key_valid = _inputs(B, KV, G, hd, max_len, torch.float32, device, gen)
        for s in (5, S - 1):  # >= the largest pad (5): every row sees a key, so SDPA is NaN-free
            slot = torch.tensor(s, device=device)
            ref = decode_attention_reference(q, k, v, key_valid, slot, S, 0.3)
            mask = (key_valid[:, :S] & (torch.arange(S, device=device) <= slot))[:, None, None, :]
            kr, vr = (t[:, :, :S].repeat_interleave(G, dim=1) for t in (k, v))
            sdpa = F.scaled_dot_product_attention(q[:, :, None], kr, vr, attn_mask=mask, scale=0.3)[:, :, 0]
            if not torch.allclose(ref, sdpa, atol=1e-5, rtol=1e-5):
                fails.append(f"sdpa {(B, KV, G, hd, S)} slot={s}: max diff {(ref - sdpa).abs().max().item():.3g}")
    return fails


def interpreter_suite() -> list[str]:
    return check_kernel("cpu") + check_kernel("cpu", torch.float16, seed=1, cases=CASES[1:3])


def test_interpreter():
    fails = run_interpreter_suite("test_decode_attention", timeout=600)
    assert not fails, "\n".join(fails)


def test_reference_matches_sdpa():
    fails = check_reference_vs_sdpa("cpu")
    assert not fails, "\n".join(fails)


def test_cpu_path_is_the_reference():
    """Off CUDA the public entry is the reference, rounded once to q's dtype."""
    from qerl.kernels.decode_attention import decode_attention, decode_attention_reference

    gen = torch.Generator().manual_seed(3)
    q, k, v, key_valid = _inputs(2, 2, 3, 64, 30, torch.bfloat16, "cpu", gen)
    slot = torch.tensor(17)
    out = decode_attention(q, k, v, key_valid, slot, 24, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 6, 64)
    assert torch.equal(out, decode_attention_reference(q, k, v, key_valid, slot, 24, 0.125))
    ref32 = decode_attention_reference(q.float(), k.float(), v.float(), key_valid, slot, 24, 0.125)
    assert torch.equal(out, ref32.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu(dtype):
    require_cuda()
    fails = check_kernel("cuda", dtype, cases=GPU_CASES) + check_kernel("cuda", dtype, seed=5, public=True)
    fails += check_reference_vs_sdpa("cuda")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_gpu_graph_replay_reads_slot_on_device():
    """Captured once, replayed with new slot values (as the engine's decode graph is): matches the reference."""
    require_cuda()
    from qerl.kernels.decode_attention import decode_attention, decode_attention_reference

    gen = torch.Generator().manual_seed(6)
    q, k, v, key_valid = _inputs(4, 2, 7, 128, 512, torch.bfloat16, "cuda", gen)
    S = 300
    slot = torch.tensor(10, device="cuda")
    graph, out = capture_graph(lambda: decode_attention(q, k, v, key_valid, slot, S, 0.09))
    for s in (0, 10, 150, S - 1):
        slot.fill_(s)
        graph.replay()
        ref = decode_attention_reference(q.float(), k.float(), v.float(), key_valid, slot, S, 0.09)
        assert _error(out, ref) <= TOL[torch.bfloat16], f"slot {s}: {_error(out, ref):.3g}"
