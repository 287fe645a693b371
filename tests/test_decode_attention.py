"""The decode-attention Triton kernel against the fp32 torch reference, and the reference against SDPA.

Inputs are 16-bit; the reference is computed from the same values in fp32. Error: max abs difference over
the reference's max abs value, <= 1e-2 (bf16) / 2e-3 (fp16). Every buffer the kernels write is filled with
NaN first (`workspace.poisoned_outputs`), and every cache slot a query must not see (left pads, slots
past the decode slot, slots >= S) holds NaN, so an unwritten element or a leaked key fails. Run on the CPU
through the Triton interpreter (subprocess) and directly on a GPU, where a CUDA-graph replay with new slot
values is checked too.

gpt-oss's sinks (a logit per query head in each softmax's denominator, no value) and sliding windows (key j
visible to the query at position p iff p - j < window): the reference against an independent float64
computation (an explicit sink column, the window from each row's positions under left padding), the kernel
against the reference (sinks, windows, both; splits; dummy rows; NaN outside the window), at gpt-oss-20b's
head shapes on the GPU, and the engine's decode through the kernel against its SDPA path.
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


def _hide_unseen(k, v, key_valid, slot, S, window=None):
    """Copies of k, v with NaN in every slot the query must not read."""
    j = torch.arange(k.shape[2], device=k.device)
    seen = key_valid & (j <= slot.reshape(-1, 1)) & (j < S)
    if window is not None:
        seen &= slot.reshape(-1, 1) - j < window
    hidden = ~seen[:, None, :, None]
    return k.masked_fill(hidden, float("nan")), v.masked_fill(hidden, float("nan"))


def _blind_rows_are_zeros(out, key_valid, slot, S, window=None) -> bool:
    """Whether every row that sees no key (no valid slot up to its own within S, and the window) is all zeros."""
    j = torch.arange(S, device=key_valid.device)
    seen = key_valid[:, :S] & (j <= slot.reshape(-1, 1))
    if window is not None:
        seen &= slot.reshape(-1, 1) - j < window
    blind = ~seen.any(1)
    return not blind.any() or bool((out[blind] == 0).all())


def _error(out, ref) -> float:
    """Max error relative to the reference's largest entry, floored at the smallest normal of out's dtype: an
    output whose every entry lies below float16's normal range (a sink outweighing the only visible key by
    e^27) flushes to zeros that are right to within that dtype's resolution."""
    if not torch.isfinite(out).all():
        return float("inf")
    floor = torch.finfo(out.dtype).tiny if out.dtype.is_floating_point else 1e-30
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(max(floor, 1e-30))).item()


def check_kernel(device: str, dtype=torch.bfloat16, seed: int = 0, cases=CASES, public: bool = False) -> list[str]:
    """Kernel vs fp32 reference for each case at slots 0, a middle one and S - 1, plus huge q/k values."""
    from qerl.kernels.triton import decode_attention as tda
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


def explicit_attention(q, k, v, key_valid, slot, S, scale, sinks=None, window=None):
    """float64, one (row, head) at a time: positions counted over each row's valid slots (left pads hold
    none), visible keys = valid, slot <= the query's, position within the window; the softmax over their
    scores plus a sink column, which is dropped before the weighted sum. No visible key: zeros."""
    q, k, v, key_valid, slot = (t.cpu() for t in (q, k, v, key_valid, slot))
    sinks = None if sinks is None else sinks.cpu()
    B, H, hd = q.shape
    KV = k.shape[1]
    slots = slot.reshape(-1).expand(B).tolist()
    out = torch.zeros(B, H, hd, dtype=torch.float64)
    for b in range(B):
        pos = key_valid[b].long().cumsum(0) - 1  # the position of each valid slot
        qpos = int(pos[slots[b]])
        keys = [j for j in range(min(S, slots[b] + 1))
                if key_valid[b, j] and (window is None or qpos - int(pos[j]) < window)]
        for h in range(H):
            kvh = h // (H // KV)
            logits = [float(q[b, h].double() @ k[b, kvh, j].double()) * scale for j in keys]
            if sinks is not None:
                logits.append(float(sinks[h]))
            if not keys:
                continue
            m = max(logits)
            e = [torch.tensor(x - m, dtype=torch.float64).exp() for x in logits]
            total = sum(e)
            for w, j in zip(e, keys):
                out[b, h] += w / total * v[b, kvh, j].double()
    return out


# (B, KV, G, hd, S, max_len, block_n, splits, window, sinks): sinks "f32" / "model" (q's dtype) / None; windows
# shorter than a tile, spanning several (and splits of them), 1, longer than S; one split and several
WINDOW_CASES = [
    (2, 2, 3, 64, 90, 96, 16, 1, None, "f32"),  # sinks only, the direct path
    (2, 2, 3, 64, 90, 96, 16, 3, None, "model"),  # sinks only, the combine pass
    (3, 1, 4, 32, 120, 128, 16, None, 40, None),  # window only, splits of the window's span
    (2, 2, 2, 64, 100, 112, 16, 1, 7, "f32"),  # both, a window shorter than a tile
    (2, 2, 2, 64, 100, 112, 16, 3, 40, "f32"),  # both, 3 splits of 16 keys over the window
    (2, 1, 3, 32, 70, 80, 16, 2, 500, "model"),  # a window longer than S: the full-attention result
    (3, 2, 2, 32, 60, 64, 16, 2, 1, "f32"),  # window 1: the query's own key (and the sink)
    (3, 2, 3, 64, 150, 160, None, None, 20, "f32"),  # B * KV >= the 4 "SMs": the wide tile, one split
]
GPU_WINDOW_CASES = WINDOW_CASES + [(2, 8, 8, 64, 2048, 2100, None, None, 128, "model"),
                                   (1, 8, 8, 64, 2000, 2048, 64, 5, 300, "f32")]


def check_sinks_window(device: str, dtype=torch.bfloat16, seed: int = 7, cases=WINDOW_CASES) -> list[str]:
    """Kernel with sinks and/or a window vs the fp32 reference at slots 0, a middle one, S - 1 and one per
    row; slots outside the window hold NaN; the last row of every other case has no valid key (zeros out);
    sinks large and small against the scores (magnitude 30: the sink wins or loses the softmax's max)."""
    from qerl.kernels.triton import decode_attention as tda
    from qerl.kernels.decode_attention import decode_attention_reference

    fails = []
    gen = torch.Generator().manual_seed(seed)
    with poisoned_outputs():
        for i, (B, KV, G, hd, S, max_len, block_n, splits, window, sink_kind) in enumerate(cases):
            for magnitude in (1.0, 30.0) if i % 2 == 0 else (1.0,):
                q, k, v, key_valid = _inputs(B, KV, G, hd, max_len, dtype, device, gen)
                if i % 2 == 1:
                    key_valid[-1] = False
                sinks = None
                if sink_kind is not None:
                    sinks = (torch.randn(G * KV, generator=gen) * 2 * magnitude).to(device)
                    sinks = sinks.to(dtype) if sink_kind == "model" else sinks
                k = k * magnitude  # scores of order magnitude * sqrt(hd): the sink wins or loses the max
                scale = hd ** -0.5
                for s in (0, S // 2 + 1, S - 1, "per row"):
                    slot = torch.tensor(s, dtype=torch.int64, device=device) if s != "per row" else \
                        torch.randint(0, S, (B,), generator=gen).to(device)
                    kn, vn = _hide_unseen(k, v, key_valid, slot, S, window)
                    out = tda.decode_attention_triton(q, kn, vn, key_valid, slot, S, scale, splits, block_n,
                                                      sinks=sinks, window=window)
                    ref = decode_attention_reference(q.float(), k.float(), v.float(), key_valid, slot, S, scale,
                                                     sinks, window)
                    tag = f"{device} {dtype} window case={i} mag={magnitude} slot={s}"
                    if out.dtype != dtype or out.shape != ref.shape:
                        fails.append(f"{tag}: got {out.dtype} {tuple(out.shape)}")
                        continue
                    err = _error(out, ref)
                    if err > TOL[dtype]:
                        fails.append(f"{tag}: relative max error {err:.3g}")
                    if not _blind_rows_are_zeros(out, key_valid, slot, S, window):
                        fails.append(f"{tag}: a row with no visible key is not all zeros")
    return fails


def check_reference_sinks_window(device: str = "cpu", seed: int = 4) -> list[str]:
    """The fp32 reference with sinks / windows equals `explicit_attention` (left-padded rows, a slot per row,
    a row with no valid key)."""
    from qerl.kernels.decode_attention import decode_attention_reference

    fails = []
    gen = torch.Generator().manual_seed(seed)
    for B, KV, G, hd, S, max_len in [(3, 2, 3, 16, 30, 36), (2, 1, 4, 32, 17, 17)]:
        q, k, v, key_valid = _inputs(B, KV, G, hd, max_len, torch.float32, device, gen, magnitude=2.0)
        key_valid[-1, :] = False
        sinks = (torch.randn(G * KV, generator=gen) * 3).to(device)
        for window in (None, 1, 4, 100):
            for sk in (None, sinks):
                for slot in (torch.tensor(S - 1), torch.randint(0, S, (B,), generator=gen)):
                    slot = slot.to(device)
                    if window is None and sk is None:
                        continue
                    ref = decode_attention_reference(q, k, v, key_valid, slot, S, 0.3, sk, window)
                    want = explicit_attention(q, k, v, key_valid, slot, S, 0.3, sk, window)
                    diff = (ref.double().cpu() - want).abs().max().item()
                    if not diff < 1e-5:
                        fails.append(f"reference {(B, KV, G, hd, S)} window={window} sinks={sk is not None} "
                                     f"slot={slot.tolist()}: max diff {diff:.3g}")
    return fails


def check_reference_sinks_vs_sdpa(device: str, seed: int = 5) -> list[str]:
    """With sinks and a window, the reference equals the engine's SDPA path (`sink_attention` with
    `within_window`), which rows with no visible key leave at zeros as well."""
    from qerl.kernels.decode_attention import decode_attention_reference
    from qerl.rollout.model_runner import sink_attention, within_window

    fails = []
    gen = torch.Generator().manual_seed(seed)
    B, KV, G, hd, S, max_len = 3, 2, 4, 64, 40, 48
    q, k, v, key_valid = _inputs(B, KV, G, hd, max_len, torch.float32, device, gen)
    key_valid[-1] = False
    sinks = (torch.randn(G * KV, generator=gen) * 2).to(device)
    for window in (None, 6):
        slot = torch.tensor([S - 1, 12, 30], device=device)
        mask = (key_valid[:, :S] & (torch.arange(S, device=device) <= slot[:, None]))[:, None, None, :]
        if window is not None:
            mask = mask & within_window(mask, slot, window)
        sdpa = sink_attention(q[:, :, None], k[:, :, :S], v[:, :, :S], mask, 0.2, sinks)[:, :, 0]
        ref = decode_attention_reference(q, k, v, key_valid, slot, S, 0.2, sinks, window)
        if not torch.allclose(ref, sdpa, atol=1e-5, rtol=1e-5):
            fails.append(f"sinks vs sdpa window={window}: max diff {(ref - sdpa).abs().max().item():.3g}")
    return fails


# (B, KV, G, hd, S, max_len, block_n, splits, window, sinks): the direct path, splits, a window, sinks
ROPE_CASES = [
    (2, 2, 3, 64, 40, 48, 16, 1, None, False),
    (3, 1, 2, 64, 77, 96, 16, 3, None, False),
    (2, 2, 2, 32, 60, 64, 16, 2, 20, True),
]
GPU_ROPE_CASES = ROPE_CASES + [(4, 4, 7, 128, 600, 640, None, None, None, False),
                               (1, 2, 6, 128, 700, 768, None, None, None, False)]


def _rope_inputs(B, KV, G, hd, dtype, device, gen, positions):
    """This token's q [B, 1, H, hd] (a strided view), k, v [B, 1, KV, hd] before RoPE, and cos, sin [B, 1, hd] at
    `positions` [B] (HF's layout: the frequencies twice)."""
    H = G * KV
    q = torch.randn(B, 1, H, 2 * hd, generator=gen).to(dtype)[..., :hd]
    k = torch.randn(B, 1, KV, hd, generator=gen).to(dtype)
    v = torch.randn(B, 1, KV, hd, generator=gen).to(dtype)
    freqs = positions.cpu().double()[:, None] * 10000.0 ** (-torch.arange(0, hd, 2).double() / hd)[None, :]
    angles = torch.cat([freqs, freqs], -1)[:, None, :]
    return [t.to(device) for t in (q, k, v, angles.cos().to(dtype), angles.sin().to(dtype))]


def check_rope_store(device: str, dtype=torch.bfloat16, seed: int = 11, cases=ROPE_CASES) -> list[str]:
    """RoPE and the k/v write inside the attention kernel: the caches afterwards equal `rope_qk_store`'s (the
    torch reference on the CPU) bit for bit, slot and all, every other slot untouched (NaN stays NaN); the output
    equals the unfused kernel's on the rotated q bit for bit and the fp32 reference within TOL. The slot holds
    NaN before the call, so a read of it before the write fails."""
    from qerl.kernels.decode_attention import decode_attention_reference
    from qerl.kernels.fused_ops import rope_qk_store
    from qerl.kernels.triton import decode_attention as tda

    fails = []
    gen = torch.Generator().manual_seed(seed)
    with poisoned_outputs():
        for i, (B, KV, G, hd, S, max_len, block_n, splits, window, has_sinks) in enumerate(cases):
            _, k_cache, v_cache, key_valid = _inputs(B, KV, G, hd, max_len, dtype, device, gen)
            sinks = (torch.randn(G * KV, generator=gen) * 2).to(device) if has_sinks else None
            scale = hd ** -0.5
            for s in (0, S // 2 + 1, S - 1, "per row"):
                slot = torch.tensor(s, dtype=torch.int64, device=device) if s != "per row" else \
                    torch.randint(0, S, (B,), generator=gen).to(device)
                q, k, v, cos, sin = _rope_inputs(B, KV, G, hd, dtype, device, gen, slot.expand(B) + 3)
                kc, vc = _hide_unseen(k_cache, v_cache, key_valid, slot, S, window)
                rows = torch.arange(B, device=device)
                kc[rows, :, slot.expand(B)] = float("nan")  # what the kernel must write before it reads
                vc[rows, :, slot.expand(B)] = float("nan")
                want_k, want_v = kc.cpu().clone(), vc.cpu().clone()
                rq = rope_qk_store(q.cpu(), k.cpu(), v.cpu(), cos.cpu(), sin.cpu(), want_k, want_v, slot.cpu())
                out = tda.decode_attention_triton(q[:, 0], kc, vc, key_valid, slot, S, scale, splits, block_n,
                                                  sinks=sinks, window=window,
                                                  rope=(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0]))
                tag = f"{device} {dtype} rope case={i} slot={s}"
                for name, got, want in (("k cache", kc, want_k), ("v cache", vc, want_v)):
                    if not torch.equal(got.cpu().nan_to_num(7.0), want.nan_to_num(7.0)) or \
                            not torch.equal(got.cpu().isnan(), want.isnan()):
                        fails.append(f"{tag}: the {name} differs from rope_qk_store's")
                unfused = tda.decode_attention_triton(rq[:, 0].to(device), kc, vc, key_valid, slot, S, scale,
                                                      splits, block_n, sinks=sinks, window=window)
                if not torch.equal(out, unfused):
                    fails.append(f"{tag}: differs from the unfused kernel by "
                                 f"{(out.float() - unfused.float()).abs().max().item():.3g}")
                ref = decode_attention_reference(rq[:, 0].float(), want_k.float(), want_v.float(), key_valid.cpu(),
                                                 slot.cpu(), S, scale, None if sinks is None else sinks.cpu(), window)
                if _error(out.cpu(), ref) > TOL[dtype]:
                    fails.append(f"{tag}: relative max error {_error(out.cpu(), ref):.3g}")
    return fails


# (B, KV, G, hd, S, max_len, block_n, splits, window, sinks, rope): the merge needs splits > 1
MERGE_CASES = [
    (2, 2, 7, 128, 77, 96, 16, 3, None, None, False),
    (3, 1, 2, 64, 96, 100, 16, 5, None, "f32", False),  # sinks: joined once, in the merge
    (2, 2, 2, 64, 100, 112, 16, 3, 40, "model", False),  # a window, sinks in q's dtype
    (2, 2, 3, 64, 90, 96, 16, 4, None, None, True),  # RoPE and the k/v write in the same launch
    (1, 1, 1, 64, 40, 48, 16, 2, None, None, False),  # G = 1: one real head in the BLOCK_G tile
]
GPU_MERGE_CASES = MERGE_CASES + [(1, 4, 7, 128, 700, 768, None, None, None, None, True),  # 7B heads, 1 row
                                 (8, 4, 7, 128, 300, 512, 64, None, None, None, False),
                                 (2, 8, 8, 64, 2048, 2100, None, None, 128, "model", False)]


def check_merge(device: str, dtype=torch.bfloat16, seed: int = 13, cases=MERGE_CASES) -> list[str]:
    """The splits merged by the last program (`merge=True`): within TOL of the fp32 reference, the combine pass's
    output bit for bit (the same sums in the same order), zeros for a row with no visible key; and every arrival
    counter back at zero after each call, so the next call (a graph replay: the same buffers) starts clean. Two
    calls per case and slot, on poisoned outputs; with RoPE, the caches hold NaN at the slot before each call
    (the kernel writes it before it reads)."""
    from qerl.kernels import workspace
    from qerl.kernels.decode_attention import decode_attention_reference
    from qerl.kernels.fused_ops import rope_qk_store
    from qerl.kernels.triton import decode_attention as tda

    fails = []
    gen = torch.Generator().manual_seed(seed)
    with poisoned_outputs():
        for i, (B, KV, G, hd, S, max_len, block_n, splits, window, sink_kind, rope) in enumerate(cases):
            q, k, v, key_valid = _inputs(B, KV, G, hd, max_len, dtype, device, gen)
            if i % 2:
                key_valid[-1] = False  # a row with no visible key
            sinks = None if sink_kind is None else (torch.randn(G * KV, generator=gen) * 2).to(device)
            if sinks is not None and sink_kind == "model":
                sinks = sinks.to(dtype)
            scale = hd ** -0.5
            for s in (S // 2 + 1, S - 1, "per row"):
                slot = torch.tensor(s, dtype=torch.int64, device=device) if s != "per row" else \
                    torch.randint(0, S, (B,), generator=gen).to(device)
                kn, vn = _hide_unseen(k, v, key_valid, slot, S, window)
                args = dict(sinks=sinks, window=window)
                query, want_k, want_v = q, k, v
                if rope:
                    qr, kr, vr, cos, sin = _rope_inputs(B, KV, G, hd, dtype, device, gen, slot.expand(B) + 3)
                    rows = torch.arange(B, device=device)
                    kn[rows, :, slot.expand(B)] = float("nan")
                    vn[rows, :, slot.expand(B)] = float("nan")
                    want_k, want_v = kn.cpu().clone(), vn.cpu().clone()
                    query = rope_qk_store(qr.cpu(), kr.cpu(), vr.cpu(), cos.cpu(), sin.cpu(), want_k, want_v,
                                          slot.cpu())[:, 0]
                    args["rope"] = (kr[:, 0], vr[:, 0], cos[:, 0], sin[:, 0])
                    query_in = qr[:, 0]
                else:
                    query_in = q
                ref = decode_attention_reference(query.float().cpu(), want_k.float().cpu(), want_v.float().cpu(),
                                                 key_valid.cpu(), slot.cpu(), S, scale,
                                                 None if sinks is None else sinks.cpu(), window)
                tag = f"{device} {dtype} merge case={i} slot={s}"
                outs = []
                for call in range(2):
                    key = counter_key(query_in.device, B, KV)
                    workspace._PERSISTENT.pop(key, None)  # this case's counters: made by this call
                    outs.append(tda.decode_attention_triton(query_in, kn.clone(), vn.clone(), key_valid, slot, S,
                                                            scale, splits, block_n, merge=True, **args))
                    counters = workspace._PERSISTENT.get(key)
                    if counters is None or int(counters.abs().sum()):
                        fails.append(f"{tag}: call {call}: no arrival counters, or not left at zero")
                combined = tda.decode_attention_triton(query_in, kn.clone(), vn.clone(), key_valid, slot, S, scale,
                                                       splits, block_n, **args)
                for out in outs:
                    if _error(out.cpu(), ref) > TOL[dtype]:
                        fails.append(f"{tag}: relative max error {_error(out.cpu(), ref):.3g}")
                    if not torch.equal(out, combined):
                        diff = (out.float() - combined.float()).abs().max().item()
                        fails.append(f"{tag}: differs from the combine pass by {diff:.3g}")
                if not torch.equal(outs[0], outs[1]):
                    fails.append(f"{tag}: two calls differ")
                if not _blind_rows_are_zeros(outs[0], key_valid, slot, S, window):
                    fails.append(f"{tag}: a row with no visible key is not all zeros")
    return fails


def counter_key(device: torch.device, B: int, KV: int) -> tuple:
    """The workspace key of the merge's arrival counters for a (B, KV) launch on `device`'s current stream."""
    from qerl.kernels import workspace

    return workspace._full_key("decode_attention", device, (B, KV))


def check_merge_direct(device: str) -> list[str]:
    """With one split there is nothing to merge: merge=True is the direct path, same output, and no counters."""
    from qerl.kernels import workspace
    from qerl.kernels.triton import decode_attention as tda

    gen = torch.Generator().manual_seed(15)
    q, k, v, key_valid = _inputs(2, 2, 3, 64, 48, torch.bfloat16, device, gen)
    slot = torch.tensor(30, device=device)
    key = counter_key(q.device, 2, 2)
    workspace._PERSISTENT.pop(key, None)
    with poisoned_outputs():
        merged = tda.decode_attention_triton(q, k, v, key_valid, slot, 40, 0.125, 1, 16, merge=True)
        direct = tda.decode_attention_triton(q, k, v, key_valid, slot, 40, 0.125, 1, 16)
    fails = [] if torch.equal(merged, direct) else ["merge with one split differs from the direct path"]
    if key in workspace._PERSISTENT:
        fails.append("merge with one split made arrival counters")
    return fails


# (B, KV, G, hd, S, max_len, block_n, splits, window, sinks, rope, R): the direct path and splits, R not a power of 2
LORA_A_CASES = [
    (2, 2, 3, 64, 40, 48, 16, 1, None, None, False, 16),
    (3, 2, 2, 64, 90, 96, 16, 3, None, None, True, 24),
    (2, 1, 4, 32, 70, 80, 16, 2, 20, "f32", False, 8),
    (1, 4, 1, 64, 60, 64, 16, 4, None, None, True, 64),  # G = 1, four kv heads into one row's sum
]
GPU_LORA_A_CASES = LORA_A_CASES + [(1, 4, 7, 128, 700, 768, None, None, None, None, True, 32),  # 7B, 1 row
                                   (8, 4, 7, 128, 300, 512, None, None, None, None, True, 16),
                                   (64, 4, 7, 128, 300, 512, None, None, None, None, True, 16)]  # the wide tile


def check_lora_a_of_o(device: str, dtype=torch.bfloat16, seed: int = 17, cases=LORA_A_CASES) -> list[str]:
    """The o projection's LoRA A product made by the attention kernel (`lora_a=`): h = out @ A^T within TOL of the
    fp32 product of the kernel's own (rounded) output, the output itself bit for bit the one without lora_a (the
    merge path's), two calls equal, the row counters left at zero; direct path and splits, RoPE, sinks, a window."""
    from qerl.kernels import workspace
    from qerl.kernels.triton import decode_attention as tda

    fails = []
    gen = torch.Generator().manual_seed(seed)
    with poisoned_outputs():
        for i, (B, KV, G, hd, S, max_len, block_n, splits, window, sink_kind, rope, R) in enumerate(cases):
            q, k, v, key_valid = _inputs(B, KV, G, hd, max_len, dtype, device, gen)
            sinks = None if sink_kind is None else (torch.randn(G * KV, generator=gen) * 2).to(device)
            a = (torch.randn(R, G * KV * hd, generator=gen) * 0.05).to(dtype).to(device)
            slot = torch.randint(0, S, (B,), generator=gen).to(device)
            kn, vn = _hide_unseen(k, v, key_valid, slot, S, window)
            args = dict(sinks=sinks, window=window)
            query = q
            if rope:
                qr, kr, vr, cos, sin = _rope_inputs(B, KV, G, hd, dtype, device, gen, slot + 3)
                query, args["rope"] = qr[:, 0], (kr[:, 0], vr[:, 0], cos[:, 0], sin[:, 0])
            tag = f"{device} {dtype} lora_a case={i}"
            got = [tda.decode_attention_triton(query, kn.clone(), vn.clone(), key_valid, slot, S, scale=hd ** -0.5,
                                               splits=splits, block_n=block_n, lora_a=a, **args) for _ in range(2)]
            plain = tda.decode_attention_triton(query, kn.clone(), vn.clone(), key_valid, slot, S, scale=hd ** -0.5,
                                                splits=splits, block_n=block_n, merge=True, **args)
            (out, h), (out2, h2) = got
            if not (torch.equal(out, plain) and torch.equal(out, out2) and torch.equal(h, h2)):
                fails.append(f"{tag}: the output changed with lora_a, or two calls differ")
            want = out.float().reshape(B, -1) @ a.float().t()
            if h.shape != (B, R) or h.dtype != dtype or _error(h, want) > TOL[dtype]:
                fails.append(f"{tag}: h {tuple(h.shape)} {h.dtype}, relative max error {_error(h, want):.3g}")
            counters = [t for key, t in workspace._PERSISTENT.items() if key[0] == "decode_attention_lora_a"]
            if not counters or any(int(c[1].abs().sum()) for c in counters):
                fails.append(f"{tag}: a row counter was not left at zero")
    try:
        tda.decode_attention_triton(q, k, v, key_valid, slot, S, 0.1, lora_a=torch.zeros(4, 7, dtype=dtype,
                                                                                           device=device))
        fails.append("a lora_a of the wrong width was taken")
    except ValueError:
        pass
    return fails


def merge_interpreter_suite() -> list[str]:
    return check_merge("cpu") + check_merge("cpu", torch.float16, seed=14, cases=MERGE_CASES[:2]) + \
        check_merge_direct("cpu") + check_lora_a_of_o("cpu") + check_lora_a_of_o("cpu", torch.float16, seed=18,
                                                                                  cases=LORA_A_CASES[1:2])


def rope_store_interpreter_suite() -> list[str]:
    return check_rope_store("cpu") + check_rope_store("cpu", torch.float16, seed=12, cases=ROPE_CASES[1:2])


def interpreter_suite() -> list[str]:
    return check_kernel("cpu") + check_kernel("cpu", torch.float16, seed=1, cases=CASES[1:3])


def sinks_window_interpreter_suite() -> list[str]:
    return check_sinks_window("cpu") + check_sinks_window("cpu", torch.float16, seed=8, cases=WINDOW_CASES[1:7:2])


def test_interpreter():
    fails = run_interpreter_suite("test_decode_attention", timeout=600)
    assert not fails, "\n".join(fails)


def test_interpreter_sinks_window():
    fails = run_interpreter_suite("test_decode_attention", "sinks_window_interpreter_suite", timeout=600)
    assert not fails, "\n".join(fails)


def test_interpreter_rope_store():
    fails = run_interpreter_suite("test_decode_attention", "rope_store_interpreter_suite", timeout=600)
    assert not fails, "\n".join(fails)


def test_interpreter_merge_in_the_split_kernel():
    fails = run_interpreter_suite("test_decode_attention", "merge_interpreter_suite", timeout=600)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_merge_in_the_split_kernel(dtype):
    require_cuda()
    fails = check_merge("cuda", dtype, cases=GPU_MERGE_CASES) + check_merge_direct("cuda")
    fails += check_lora_a_of_o("cuda", dtype, cases=GPU_LORA_A_CASES)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rope_store(dtype):
    require_cuda()
    fails = check_rope_store("cuda", dtype, cases=GPU_ROPE_CASES)
    assert not fails, "\n".join(fails)


def test_reference_matches_sdpa():
    fails = check_reference_vs_sdpa("cpu")
    assert not fails, "\n".join(fails)


def test_reference_sinks_window_matches_explicit_and_sdpa():
    fails = check_reference_sinks_window() + check_reference_sinks_vs_sdpa("cpu")
    assert not fails, "\n".join(fails)


def test_cpu_path_with_sinks_window_is_the_reference():
    from qerl.kernels.decode_attention import decode_attention, decode_attention_reference

    gen = torch.Generator().manual_seed(9)
    q, k, v, key_valid = _inputs(2, 2, 3, 64, 30, torch.bfloat16, "cpu", gen)
    sinks, slot = torch.randn(6, generator=gen).to(torch.bfloat16), torch.tensor([20, 9])
    out = decode_attention(q, k, v, key_valid, slot, 24, 0.125, sinks=sinks, window=5)
    assert torch.equal(out, decode_attention_reference(q, k, v, key_valid, slot, 24, 0.125, sinks, 5))
    assert not torch.equal(out, decode_attention(q, k, v, key_valid, slot, 24, 0.125, window=5))
    assert not torch.equal(out, decode_attention(q, k, v, key_valid, slot, 24, 0.125, sinks=sinks))


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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sinks_window(dtype):
    require_cuda()
    fails = check_sinks_window("cuda", dtype, cases=GPU_WINDOW_CASES)
    fails += check_reference_sinks_window("cuda") + check_reference_sinks_vs_sdpa("cuda")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_gpt_oss_20b_heads(B):
    """gpt-oss-20b's attention (64 query heads, 8 kv heads, head dim 64, bf16 sinks, window 128 on every other
    layer) through the public entry, production tile and split choice, S up to 2048 as the engine's graphs
    scan (the whole cache) and shorter, one slot for all rows and one per row."""
    require_cuda()
    from qerl.kernels.decode_attention import decode_attention, decode_attention_reference

    gen = torch.Generator().manual_seed(10 + B)
    max_len = 2048
    q, k, v, key_valid = _inputs(B, 8, 8, 64, max_len, torch.bfloat16, "cuda", gen)
    sinks = torch.randn(64, generator=gen).to("cuda", torch.bfloat16)
    fails = []
    with poisoned_outputs():
        for window in (128, None):
            for S in (100, 700, 2048):
                for s in (S - 1, "per row"):
                    slot = torch.tensor(s, device="cuda") if s != "per row" else \
                        torch.randint(0, S, (B,), generator=gen).to("cuda")
                    kn, vn = _hide_unseen(k, v, key_valid, slot, S, window)
                    out = decode_attention(q, kn, vn, key_valid, slot, S, 0.125, sinks=sinks, window=window)
                    ref = decode_attention_reference(q.float(), k.float(), v.float(), key_valid, slot, S, 0.125,
                                                     sinks, window)
                    err = _error(out, ref)
                    if err > TOL[torch.bfloat16]:
                        fails.append(f"B={B} window={window} S={S} slot={s}: relative max error {err:.3g}")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_gpu_graph_replay_sinks_window():
    """Captured once with sinks and a window, replayed with new per-row slots: the window follows the slots."""
    require_cuda()
    from qerl.kernels.decode_attention import decode_attention, decode_attention_reference

    gen = torch.Generator().manual_seed(11)
    q, k, v, key_valid = _inputs(4, 8, 8, 64, 1024, torch.bfloat16, "cuda", gen)
    sinks = torch.randn(64, generator=gen).to("cuda", torch.bfloat16)
    S = 1024
    slot = torch.full((4,), 10, device="cuda")
    graph, out = capture_graph(lambda: decode_attention(q, k, v, key_valid, slot, S, 0.125, sinks=sinks, window=128))
    for s in ([0, 10, 127, 128], [129, 500, 1000, S - 1]):
        slot.copy_(torch.tensor(s))
        graph.replay()
        ref = decode_attention_reference(q.float(), k.float(), v.float(), key_valid, slot, S, 0.125, sinks, 128)
        assert _error(out, ref) <= TOL[torch.bfloat16], f"slots {s}: {_error(out, ref):.3g}"


@pytest.mark.gpu
def test_gpu_engine_gpt_oss_decode_equals_the_sdpa_path(monkeypatch):
    """The tiny gpt-oss (sinks on both layers, window 3 on layer 0) decoding on CUDA: its sink / window layers
    through `rope_store_decode_attention` (`model_runner.SINKS_WINDOW_DECODE_KERNEL`) equal the SDPA path -- in fp32
    (the reference) token for token, in bf16 (the Triton kernel) on log-probs up to each row's first
    differing token, and against a full forward."""
    require_cuda()
    import warnings

    from qerl.rollout import model_runner
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    from test_gpt_oss import tiny_gpt_oss
    from test_rollout_engine import completions, full_forward_logprobs, prompts_of
    from test_rollout_moe import quantized

    calls = []
    real = model_runner.rope_store_decode_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("sinks") is not None, kwargs.get("window")))
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, "rope_store_decode_attention", recording)
    prompts = prompts_of([5, 11, 3, 8], seed=3)
    greedy = SamplingParams(temperature=0)

    def run(model, kernel):
        monkeypatch.setattr(model_runner, "SINKS_WINDOW_DECODE_KERNEL", kernel)
        calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp32 experts: "without CUDA graphs"
            out = RolloutEngine(model, max_seq_len=64, max_batch=4).generate(prompts, 24, greedy, ignore_eos=True)
        return out, set(calls)

    model = quantized(tiny_gpt_oss()).cuda()
    kern, seen = run(model, True)
    assert seen == {(True, 3), (True, None)}, seen
    sdpa, seen = run(model, False)
    assert seen == set()
    assert completions(kern) == completions(sdpa)
    torch.testing.assert_close(kern.logprobs, sdpa.logprobs, atol=1e-4, rtol=1e-4)

    model = model.to(torch.bfloat16)
    kern, seen = run(model, True)
    assert seen == {(True, 3), (True, None)}, seen
    sdpa, _ = run(model, False)
    same = (kern.completion_ids == sdpa.completion_ids).long().cumprod(1).bool()  # up to the first difference
    same = same & kern.completion_mask & sdpa.completion_mask
    assert (kern.logprobs - sdpa.logprobs)[same].abs().max() < 0.05
    # greedy on a near-flat random model in bf16 parts soon: each path against a full forward of its own tokens
    err = [(out.logprobs - full_forward_logprobs(model, out, 1.0)[0]).abs().mean().item() for out in (kern, sdpa)]
    assert err[0] < 0.05 and err[0] < 2 * err[1] + 0.01, err


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_gpu_engine_lora_a_of_o_in_the_attention_kernel(kind, monkeypatch):
    """NVFP4 + a non-zero LoRA, greedy over 100 tokens: with o_proj's LoRA A product made by the attention kernel
    (`decode_attention.FUSED_LORA_A_O`) the engine picks the same tokens as with its own launch, log-probs within
    bf16 noise (the product is the same sum in another order), and a second fused run the same tokens again."""
    require_cuda()
    from qerl.kernels import decode_attention as da
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    from test_rollout_engine import completions, prompts_of, quantize_tiny, tiny_model

    from qerl.kernels.triton import decode_attention as tda

    model = quantize_tiny(tiny_model(kind)).cuda().to(torch.bfloat16)
    prompts = prompts_of([5, 11, 3, 8], seed=8)
    calls, fn = [], tda.decode_attention_triton
    monkeypatch.setattr(tda, "decode_attention_triton",
                        lambda *a, **kw: calls.append(kw.get("lora_a") is not None) or fn(*a, **kw))

    def run(fused):
        monkeypatch.setattr(da, "FUSED_LORA_A_O", fused)
        engine = RolloutEngine(model, max_seq_len=160, max_batch=4)
        return engine.generate(prompts, 100, SamplingParams(temperature=0), ignore_eos=True)

    fused = run(True)
    assert any(calls), "the attention kernel was never given lora_a"
    calls.clear()
    separate = run(False)
    assert not any(calls) and completions(fused) == completions(separate)
    assert (fused.logprobs - separate.logprobs).abs().max() < 2e-2
    assert completions(run(True)) == completions(fused)


@pytest.mark.gpu
def test_gpu_engine_lora_a_of_down_in_the_swiglu_launch(monkeypatch):
    """NVFP4 + a non-zero LoRA, greedy over 100 tokens: with down_proj's LoRA A product made by the SwiGLU launch
    (`fused_ops.FUSED_SILU_LORA_A`) the same tokens as with its own launch, log-probs within bf16 noise."""
    require_cuda()
    from qerl.kernels import fused_ops
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    from test_rollout_engine import completions, prompts_of, quantize_tiny, tiny_model

    from qerl.kernels.triton import fused_ops as triton_fused_ops

    model = quantize_tiny(tiny_model("qwen2")).cuda().to(torch.bfloat16)
    prompts = prompts_of([5, 11, 3, 8], seed=9)
    calls, fn = [], triton_fused_ops.silu_mul_lora_a
    monkeypatch.setattr(triton_fused_ops, "silu_mul_lora_a", lambda *a: calls.append(1) or fn(*a))

    def run(fused):
        monkeypatch.setattr(fused_ops, "FUSED_SILU_LORA_A", fused)
        engine = RolloutEngine(model, max_seq_len=160, max_batch=4)
        return engine.generate(prompts, 100, SamplingParams(temperature=0), ignore_eos=True)

    fused = run(True)
    assert calls, "the fused launch was not taken"
    calls.clear()
    separate = run(False)
    assert not calls and completions(fused) == completions(separate)
    assert (fused.logprobs - separate.logprobs).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_gpu_engine_merge_in_the_split_kernel_changes_nothing(kind, monkeypatch):
    """The engine's greedy decode over 200 tokens (so the attention runs in several splits) with the splits merged
    by their last program gives the same tokens and log-probs, bit for bit, as with the combine launch
    (`decode_attention.FUSED_COMBINE`), whichever runs first."""
    require_cuda()
    from qerl.kernels import decode_attention as da
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    from test_rollout_engine import completions, prompts_of, tiny_model

    model = tiny_model(kind).cuda().to(torch.bfloat16)
    prompts = prompts_of([5, 11, 3, 8], seed=6)

    def run(merge):
        monkeypatch.setattr(da, "FUSED_COMBINE", merge)
        engine = RolloutEngine(model, max_seq_len=256, max_batch=4)
        return engine.generate(prompts, 200, SamplingParams(temperature=0), ignore_eos=True)

    runs = [run(True), run(False), run(True)]
    assert completions(runs[0]) == completions(runs[1]) == completions(runs[2])
    assert torch.equal(runs[0].logprobs, runs[1].logprobs) and torch.equal(runs[1].logprobs, runs[2].logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("fused_default", [True, False])
def test_gpu_engine_rope_store_in_the_attention_kernel_changes_nothing(kind, fused_default, monkeypatch):
    """The engine's greedy decode (bf16, CUDA graphs, a left-padded batch of 4) with RoPE and the k/v write inside
    the attention kernel gives the same tokens and log-probs, bit for bit, as with them in a launch of their own
    (`decode_attention.FUSED_ROPE_STORE`), whichever of the two runs first."""
    require_cuda()
    from qerl.kernels import decode_attention as da
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    from test_rollout_engine import completions, prompts_of, tiny_model

    model = tiny_model(kind).cuda().to(torch.bfloat16)
    prompts = prompts_of([5, 11, 3, 8], seed=4)

    def run(fused):
        monkeypatch.setattr(da, "FUSED_ROPE_STORE", fused)
        return RolloutEngine(model, max_seq_len=64, max_batch=4).generate(prompts, 24, SamplingParams(temperature=0),
                                                                           ignore_eos=True)

    first = run(fused_default)
    second = run(not fused_default)
    assert completions(first) == completions(second)
    assert torch.equal(first.logprobs, second.logprobs)


def test_cpu_rope_store_with_lora_a_is_the_attention_then_its_product():
    """Off CUDA, lora_a= gives the attention's output unchanged and h = lora_a(out), the LoRA A launch's own math."""
    from qerl.kernels.decode_attention import rope_store_decode_attention
    from qerl.kernels.lora_a import lora_a

    gen = torch.Generator().manual_seed(21)
    B, KV, G, hd, max_len = 2, 2, 3, 32, 40
    _, k_cache, v_cache, key_valid = _inputs(B, KV, G, hd, max_len, torch.bfloat16, "cpu", gen)
    slot = torch.tensor([20, 9])
    q, k, v, cos, sin = _rope_inputs(B, KV, G, hd, torch.bfloat16, "cpu", gen, slot + 3)
    a = (torch.randn(12, G * KV * hd, generator=gen) * 0.1).to(torch.bfloat16)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    plain = rope_store_decode_attention(q, k, v, cos, sin, *caches[0], key_valid, slot, 24, 0.125)
    out, h = rope_store_decode_attention(q, k, v, cos, sin, *caches[1], key_valid, slot, 24, 0.125, lora_a=a)
    assert torch.equal(out, plain) and torch.equal(h, lora_a(out.reshape(B, -1), a)) and h.shape == (B, 12)


def test_the_kernel_takes_lora_a_only_of_a_shape_it_can_fuse():
    from qerl.kernels.triton import decode_attention as tda

    q = torch.zeros(2, 6, 32, dtype=torch.bfloat16)
    a = torch.zeros(16, 6 * 32, dtype=torch.bfloat16)
    assert tda.lora_fits(a, q) and tda.lora_fits(torch.zeros(tda.LORA_A_MAX_R, 192, dtype=torch.bfloat16), q)
    assert not tda.lora_fits(torch.zeros(tda.LORA_A_MAX_R + 1, 192, dtype=torch.bfloat16), q)  # rank: spills
    assert not tda.lora_fits(a.float(), q) and not tda.lora_fits(a[:, :100], q)  # dtype, width
    assert not tda.lora_fits(torch.zeros(192, 16, dtype=torch.bfloat16).t(), q)  # a strided last dim


@pytest.mark.gpu
def test_gpu_ranks_the_kernels_do_not_take_fall_back_to_the_lora_a_launch():
    """A LoRA rank past the fused kernels' cap: the attention still returns (out, h) with h the LoRA A launch's,
    and the SwiGLU wrapper returns no h (the runner then makes the product itself)."""
    require_cuda()
    from qerl.kernels import fused_ops
    from qerl.kernels.decode_attention import rope_store_decode_attention
    from qerl.kernels.lora_a import lora_a

    gen = torch.Generator().manual_seed(22)
    B, KV, G, hd, max_len = 2, 2, 3, 64, 80
    _, k_cache, v_cache, key_valid = _inputs(B, KV, G, hd, max_len, torch.bfloat16, "cuda", gen)
    slot = torch.tensor([50, 20], device="cuda")
    q, k, v, cos, sin = _rope_inputs(B, KV, G, hd, torch.bfloat16, "cuda", gen, slot + 3)
    a = (torch.randn(200, G * KV * hd, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    out, h = rope_store_decode_attention(q, k, v, cos, sin, k_cache.clone(), v_cache.clone(), key_valid, slot, 60,
                                         0.125, lora_a=a)
    plain = rope_store_decode_attention(q, k, v, cos, sin, k_cache.clone(), v_cache.clone(), key_valid, slot, 60,
                                        0.125)
    assert torch.equal(out, plain) and torch.equal(h, lora_a(out.reshape(B, -1), a))
    gu = torch.randn(2, 2 * 300, generator=gen).to(torch.bfloat16).cuda()
    act, none = fused_ops.silu_mul_lora_a(gu[:, :300], gu[:, 300:], None, torch.zeros(200, 300, dtype=torch.bfloat16,
                                                                                     device="cuda"))
    assert none is None and torch.equal(act, fused_ops.silu_mul(gu[:, :300], gu[:, 300:]))
