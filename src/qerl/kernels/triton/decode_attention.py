"""Flash-decoding Triton kernel: one query token per row against a layer's static KV cache, GQA-aware.

Pass 1, grid (B, KV, splits): each program takes the G query heads of one kv head (padded to a tl.dot tile of >= 16
rows, so each k/v tile is read once for all of them) and one contiguous chunk of the first S cache slots, and keeps
an online softmax in fp32 (log2 domain). With one split it writes the output; otherwise it writes fp32 partials
(max, sum, unnormalised acc) and pass 2, one program per (row, head), merges them (or, with `merge`, the last
program of each (row, kv head) to finish merges its heads' partials itself: no second launch). When the B * KV
programs alone fill the GPU (batch 64 at 7B) there is one split of 128-key tiles (`choose_tile`), so pass 2 is not
launched. The decode slot is loaded from a device tensor inside the kernel (CUDA-graph replays see new values); keys
past it, left pads and slots >= S are never loaded, so stale or NaN cache contents there cannot leak in. A (row,
head) with no visible key outputs zeros.

gpt-oss: `sinks` (one logit per query head) join each softmax's denominator once, after the scan: in the direct
path's epilogue, or in the merge (pass 2 or the last program's; the partials stay sink-free, so splits never count
it twice); a (row, head) with no visible key still outputs zeros (the sink has no value). `window`: row b's keys are
slots [max(0, slot_b + 1 - window), slot_b], the same count of slots as positions (a row's tokens sit in consecutive
slots). The scan starts at that first slot, so pass 1 splits only min(S, window) slots and reads ceil(window /
block_n) tiles whatever S is; the tile bounds follow each row's slot, read on the device. This module imports
Triton: import it lazily (see `decode_attention`). """

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import pdl
from ..route import sm_count
from ..workspace import alloc, has_persistent, persistent
from .fp4_codes import round_to
from .fused_ops import _rounded, partial_tiles, sum_partials_last

BLOCK_N = 64  # keys per tile
PROGRAMS_PER_SM = 2
# When B * KV programs alone fill the GPU: wider tiles, no split (no combine launch), 2 stages (set from an
# H200 sweep over Qwen2.5-7B heads at batch 8-64, S = 512-1024; `qerl bench rollout` shows its effect)
WIDE = dict(block_n=128, programs_per_sm=1, num_stages=2)
CPU_SMS = 4  # the interpreter has no SMs; a small number still exercises several splits
LORA_A_MAX_R = 128  # the o projection's stacked LoRA rank the fused LoRA A product takes (one [R] tile a program)


def _sm_count(device: torch.device) -> int:
    return sm_count(device, CPU_SMS)


def choose_tile(rows: int, device: torch.device) -> tuple[int, int, int | None]:
    """(block_n, programs per SM, num_stages or None for Triton's default) for `rows` = B * KV."""
    if rows >= _sm_count(device):
        return WIDE["block_n"], WIDE["programs_per_sm"], WIDE["num_stages"]
    return BLOCK_N, PROGRAMS_PER_SM, None


def choose_splits(rows: int, S: int, block_n: int, device: torch.device,
                  programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """(splits, chunk) for `rows` = B * KV programs per split: about `programs_per_sm` programs per SM, each
    chunk a whole number of tiles, and no empty split (chunk * (splits - 1) < S)."""
    blocks = triton.cdiv(S, block_n)
    want = max(1, triton.cdiv(programs_per_sm * _sm_count(device), rows))
    chunk = triton.cdiv(blocks, min(want, blocks)) * block_n
    return triton.cdiv(S, chunk), chunk


@triton.jit
def _mma(a, b, INTERP: tl.constexpr):
    """a @ b, fp32 accumulation. The CPU interpreter's 16-bit tl.dot returns garbage (Triton 3.9): there the
    operands (exact in fp32) are multiplied in fp32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


LOG2E = 1.4426950408889634  # the kernels work in the log2 domain (exp2); the literal inside them


@triton.jit
def _rope_row(ptr, d, mask, c, s, HALF: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """x * cos + rotate_half(x) * sin for the vectors at ptr + d (d spans whole heads), rounded as
    `fused_ops._rope_halves` rounds it: round(round(x * c) + round(+-partner * s)); c, s float32 like d."""
    x = tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptr + tl.where(d < HALF, d + HALF, d - HALF), mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(d < HALF, -partner, partner)
    return round_to(_rounded(x * c, DTYPE, INTERP) + _rounded(rot * s, DTYPE, INTERP), DTYPE, INTERP)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, sink_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                  kn_ptr, vn_ptr, cos_ptr, sin_ptr, cnt_ptr, a_ptr, h_ptr, ha_ptr, cnt2_ptr, R, s_ar, s_hb,
                  S, H, G, HD, CHUNK, SPLITS, WINDOW, qk_scale, MAX_LEN,
                  sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, s_valid, so_b, so_h, s_slot, s_sink,
                  skn_b, skn_h, svn_b, svn_h, s_cos,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
                  INTERP: tl.constexpr, MERGE: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
                  LORA_A: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, NP: tl.constexpr = 1,
                  NC: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Keys [first + split * CHUNK, min(first + (split + 1) * CHUNK, S, slot + 1)) for heads kv*G .. kv*G + G - 1
    of row b, first = max(0, slot + 1 - WINDOW) with a window, else 0. The sink, if any, only where the output is
    written (the direct path, or the merge).
    ROPE: q is the query before RoPE (rotated here with row b's cos / sin), and the program whose keys hold the
    decode slot first writes this token's rotated key (kn_ptr) and value (vn_ptr) into the caches there: what
    `rope_store_decode` did in a launch of its own (a slot outside [0, MAX_LEN) writes nothing).
    MERGE (with splits): the program that arrives last at its (row, kv head)'s counter merges the SPLITS partials of
    its G heads and writes the output, what `_combine_kernel` does in a launch of its own (the counter protocol of
    `lora_a`: every thread's stores, a CTA barrier, one acq_rel atomic at GPU scope, .cg loads of the partials;
    the last program sets the counter back to 0, so every launch finds it there).
    LORA_A (direct or MERGE): the program that writes a (row, kv head)'s output also multiplies it, as rounded, by its
    heads' columns of the o projection's LoRA A [R, H * HD] (a_ptr), and the last of row b's KV programs to do so
    sums the KV partials in order and writes h [b, :R] = o[b] @ A^T (h_ptr; the same counter protocol, cnt2_ptr):
    the LoRA A product of o_proj without a launch of its own."""
    if PDL:  # launched early (`pdl`): every load and store here waits for the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)  # int64: b * stride can pass 2^31 for big caches
    kv = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv * G + g
    gd_mask = (g < G)[:, None] & (d < HD)[None, :]
    slot = tl.load(slot_ptr + b * s_slot).to(tl.int32)  # s_slot 0: one slot for every row
    if HAS_WINDOW:  # keys older than WINDOW slots are never scanned: whole tiles skipped, the rest exact
        first = tl.maximum(slot + 1 - WINDOW, 0)
    else:
        first = slot * 0
    lo = first + split * CHUNK
    hi = tl.minimum(tl.minimum(lo + CHUNK, S), slot + 1)
    k_base = k_ptr + b * sk_b + kv * sk_h
    v_base = v_ptr + b * sv_b + kv * sv_h
    if ROPE:
        dtype = q_ptr.dtype.element_ty
        c = tl.load(cos_ptr + b * s_cos + d, mask=d < HD, other=0.0).to(tl.float32)
        s_ = tl.load(sin_ptr + b * s_cos + d, mask=d < HD, other=0.0).to(tl.float32)
        q = _rope_row(q_ptr + b * sq_b + heads[:, None] * sq_h, d[None, :], gd_mask, c[None, :], s_[None, :],
                      HALF, dtype, INTERP)
        if (slot >= lo) & (slot < lo + CHUNK) & (slot < MAX_LEN):  # one split of each (row, kv head) holds it
            k_new = _rope_row(kn_ptr + b * skn_b + kv * skn_h, d, d < HD, c, s_, HALF, dtype, INTERP)
            tl.store(k_base + slot * sk_n + d, k_new, mask=d < HD)
            tl.store(v_base + slot * sv_n + d, tl.load(vn_ptr + b * svn_b + kv * svn_h + d, mask=d < HD),
                     mask=d < HD)
        tl.debug_barrier()  # the tile loads below read the slot written above (other threads of this program)
    else:
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gd_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + n
        ok = (keys < hi) & (tl.load(valid_ptr + b * s_valid + keys, mask=keys < hi, other=0) != 0)
        kd_mask = ok[:, None] & (d < HD)[None, :]
        k = tl.load(k_base + keys[:, None] * sk_n + d[None, :], mask=kd_mask, other=0.0)
        s = _mma(q, tl.trans(k), INTERP) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # no visible key yet: subtract 0 instead of -inf so exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + keys[:, None] * sv_n + d[None, :], mask=kd_mask, other=0.0)
        acc = acc * alpha[:, None] + _mma(round_to(p, v.dtype, INTERP), v, INTERP)
        m_i = m_new
    if DIRECT:
        if HAS_SINK:  # exp(sink - m) joins the denominator; no value. With no visible key: l = 1, acc = 0
            sink = tl.load(sink_ptr + heads * s_sink, mask=g < G, other=float("-inf")).to(tl.float32)
            sink = sink * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
            alpha = tl.exp2(m_i - m_fin)
            l_i = l_i * alpha + tl.exp2(sink - m_fin)
            acc = acc * alpha[:, None]
        # rounded once to the output dtype, held in fp32 (the LoRA A product reads the stored values; an opaque
        # rounding, so the compiler cannot fold it away); l_i == 0 only with acc == 0: zeros
        o = _rounded(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], out_ptr.dtype.element_ty, INTERP)
        tl.store(out_ptr + b * so_b + heads[:, None] * so_h + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=gd_mask)
        if LORA_A:
            _lora_a_of_o(o, a_ptr, h_ptr, ha_ptr, cnt2_ptr, b, kv, g, d, G, HD, R, s_ar, s_hb,
                         BLOCK_R, NP, NC, INTERP)
    else:
        part = (b * H + heads) * SPLITS + split
        tl.store(m_ptr + part, m_i, mask=g < G)
        tl.store(l_ptr + part, l_i, mask=g < G)
        tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=gd_mask)
        if MERGE:
            tl.debug_barrier()  # every thread's partial stores happen before the (single-thread) release below
            cnt = cnt_ptr + b * tl.num_programs(1) + kv
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                o = _merge_splits(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, b, heads, g < G, d, gd_mask, H, HD,
                                  SPLITS, so_b, so_h, s_sink, BLOCK_G, BLOCK_D, BLOCK_S, HAS_SINK, INTERP)
                tl.store(cnt, 0)  # every split has arrived: ready for the next launch (stream order)
                if LORA_A:
                    _lora_a_of_o(o, a_ptr, h_ptr, ha_ptr, cnt2_ptr, b, kv, g, d, G, HD, R, s_ar,
                                 s_hb, BLOCK_R, NP, NC, INTERP)


@triton.jit
def _lora_a_of_o(o, a_ptr, h_ptr, ha_ptr, cnt2_ptr, b, kv, g, d, G, HD, R, s_ar, s_hb, BLOCK_R: tl.constexpr,
                 NP: tl.constexpr, NC: tl.constexpr, INTERP: tl.constexpr):
    """o [BLOCK_G, BLOCK_D] fp32, the rounded output of heads kv*G .. kv*G + G - 1 of row b: their share of o[b] @
    A^T into row b's partial kv, then (last of the row's KV programs) h[b] = the KV partials summed
    (`sum_partials_last`), rounded once, and the counter back to 0."""
    r = tl.arange(0, BLOCK_R)
    rd_mask = (r < R)[:, None] & (d < HD)[None, :]
    p = tl.zeros([BLOCK_R], tl.float32)
    for gi in range(G):  # one head's row of o against its HD columns of A
        o_g = tl.sum(tl.where((g == gi)[:, None], o, 0.0), 0)
        a = tl.load(a_ptr + r[:, None] * s_ar + ((kv * G + gi) * HD + d)[None, :], mask=rd_mask, other=0.0)
        p += tl.sum(a.to(tl.float32) * o_g[None, :], 1)
    KV = tl.num_programs(1)
    sum_partials_last(ha_ptr + b * KV * BLOCK_R, kv, KV, p, cnt2_ptr + b, h_ptr + b * s_hb, R, BLOCK_R, NP, NC, INTERP)


@triton.jit
def _merge_splits(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, b, heads, g_mask, d, gd_mask, H, HD, SPLITS,
                  so_b, so_h, s_sink, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  HAS_SINK: tl.constexpr, INTERP: tl.constexpr):
    """The last-arriving program's merge of heads `heads` of row b: `_combine_kernel`'s math, in its order, for
    BLOCK_G heads at once (the partials' max over the splits, their rescaled sums in split order plus the sink term
    once, divided), the partials read past L1 (.cg: written by other SMs in this launch)."""
    s = tl.arange(0, BLOCK_S)
    base = (b * H + heads) * SPLITS  # [BLOCK_G]
    m = tl.load(m_ptr + base[:, None] + s[None, :], mask=g_mask[:, None] & (s < SPLITS)[None, :],
                other=float("-inf"), cache_modifier=".cg")
    m_all = tl.max(m, 1)
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads * s_sink, mask=g_mask, other=float("-inf")).to(tl.float32)
        sink = sink * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([BLOCK_G], tl.float32)
    o = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for split in range(SPLITS):  # in split order, as `_combine_kernel` sums: the same bits either way
        w = tl.exp2(tl.load(m_ptr + base + split, mask=g_mask, other=float("-inf"), cache_modifier=".cg") - m_safe)
        total += w * tl.load(l_ptr + base + split, mask=g_mask, other=0.0, cache_modifier=".cg")
        o += w[:, None] * tl.load(acc_ptr + (base + split)[:, None] * HD + d[None, :], mask=gd_mask, other=0.0,
                                  cache_modifier=".cg")
    if HAS_SINK:
        total += tl.exp2(sink - m_safe)
    o = _rounded(o / tl.where(total > 0, total, 1.0)[:, None], out_ptr.dtype.element_ty, INTERP)
    tl.store(out_ptr + b * so_b + heads[:, None] * so_h + d[None, :], o.to(out_ptr.dtype.element_ty), mask=gd_mask)
    return o  # fp32, the stored values


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, H, HD, SPLITS, so_b, so_h, s_sink,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr, INTERP: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Merge the SPLITS partials of one (row, head): rescale each to the common max, sum in split order (plus the
    head's sink term, once), divide."""
    if PDL:  # launched early (`pdl`): every load and store here waits for the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < SPLITS
    m = tl.load(m_ptr + row * SPLITS + s, mask=s_mask, other=float("-inf"))  # every partial in one round of loads
    l_s = tl.load(l_ptr + row * SPLITS + s, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + (row * SPLITS + s[:, None]) * HD + d[None, :], mask=s_mask[:, None] & (d < HD)[None, :],
                  other=0.0)
    m_all = tl.max(m, 0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + (row % H) * s_sink).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = 0.0
    o = tl.zeros([BLOCK_D], tl.float32)
    for split in range(SPLITS):  # in split order, as the merge in the split kernel sums: the same bits either way
        pick = s == split  # split's values out of the loaded tiles, exactly (a max, or a sum with zeros)
        w = tl.exp2(tl.max(tl.where(pick, m, float("-inf")), 0) - m_safe)
        total += w * tl.sum(tl.where(pick, l_s, 0.0), 0)
        o += w * tl.sum(tl.where(pick[:, None], acc, 0.0), 0)
    if HAS_SINK:
        total += tl.exp2(sink - m_safe)
    o = o / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (row // H) * so_b + (row % H) * so_h + d, round_to(o, out_ptr.dtype.element_ty, INTERP),
             mask=d < HD)


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def lora_block(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def counters_ready(device: torch.device, B: int, KV: int) -> bool:
    """Whether the merge's arrival counters of a (B, KV) launch exist on the current stream."""
    return has_persistent("decode_attention", device, (B, KV))


def lora_buffers_ready(device: torch.device, B: int, KV: int, R: int) -> bool:
    """Whether a `lora_a=` launch of this shape allocates nothing persistent (its counters and, with splits, the
    merge's): what a launch inside a CUDA-graph capture needs."""
    return has_persistent("decode_attention_lora_a", device, (B, KV, lora_block(R))) and counters_ready(device, B, KV)


def lora_fits(lora_a: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel takes `lora_a` for a q [B, H, hd] launch (else the caller computes the product)."""
    return (lora_a.dim() == 2 and lora_a.shape[1] == q.shape[1] * q.shape[2] and lora_a.dtype == q.dtype
            and lora_a.stride(1) == 1 and 0 < lora_a.shape[0] <= LORA_A_MAX_R)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_valid: torch.Tensor,
                            slot: torch.Tensor, S: int, scale: float, splits: int | None = None,
                            block_n: int | None = None, num_warps: int = 4,
                            num_stages: int | None = None, sinks: torch.Tensor | None = None,
                            window: int | None = None, rope: tuple | None = None, merge: bool = False,
                            lora_a: torch.Tensor | None = None):
    """q [B, H, hd] (bf16/fp16, unit last stride); k_cache, v_cache [B, KV, max_len, hd] (q's dtype, unit last
    stride); key_valid [B, max_len] bool; slot 0-d int64 tensor, or int64 [B] (a slot per row; read on the
    device); S <= max_len slots scanned; sinks None or [H] (any float dtype, read on the device, used in fp32):
    a logit per query head in each softmax's denominator; window None or int >= 1: only keys j with
    slot - j < window -> out [B, H, hd] in q's dtype. block_n None: `choose_tile` (with its num_stages); splits
    None: chosen from min(S, window) and the SM count (tests force both); num_warps, num_stages (None: Triton's
    default) of the first pass: tuning. rope (k, v, cos, sin): q is this token's query before RoPE, k, v [B, KV, hd]
    its key and value (unit stride on hd) and cos, sin [B, hd] (one layout, unit stride on hd) row b's RoPE rows:
    the kernel rotates q, and writes rope(k) and v into the caches at the slot before it reads them
    (`rope_store_decode`'s contract and rounding, without its launch). merge: with splits, the last program of each
    (row, kv head) merges them (no second launch; the same sums in the same order as the combine pass: the same
    output, bit for bit). lora_a [R, H * hd] (q's dtype, unit last stride): also h = out @ lora_a^T [B, R] in the
    same launch (the o projection's LoRA A product; with splits it implies merge); returns (out, h) then."""
    B, H, hd = q.shape
    KV, max_len = k_cache.shape[1], k_cache.shape[2]
    if H % KV or k_cache.shape != (B, KV, max_len, hd) or v_cache.shape != k_cache.shape or \
            not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit k/v {tuple(k_cache.shape)}")
    if key_valid.shape != (B, max_len) or key_valid.dtype != torch.bool or slot.numel() not in (1, B) \
            or slot.dtype != torch.int64 or not 0 < S <= max_len:
        raise ValueError("decode_attention: bad key_valid, slot or S")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or key_valid.stride(-1) != 1:
        raise ValueError("decode_attention needs a unit stride along head_dim and key_valid's last dim")
    if sinks is not None and (sinks.shape != (H,) or not sinks.is_floating_point() or sinks.device != q.device):
        raise ValueError(f"decode_attention: sinks must be a float [{H}] tensor on q's device")
    if window is not None and int(window) < 1:
        raise ValueError(f"decode_attention: window must be >= 1, not {window}")
    k_new = v_new = cos = sin = q  # not read without rope
    if rope is not None:
        k_new, v_new, cos, sin = rope
        if k_new.shape != (B, KV, hd) or v_new.shape != k_new.shape or cos.shape != (B, hd) or \
                sin.stride() != cos.stride() or hd % 2 or any(t.stride(-1) != 1 for t in rope) or \
                any(t.dtype != q.dtype for t in rope):
            raise ValueError("decode_attention: rope needs k, v [B, KV, hd] and cos, sin [B, hd] of q's dtype, "
                             "unit stride on hd, cos and sin of one layout, an even hd")
    if lora_a is not None and not lora_fits(lora_a, q):
        raise ValueError(f"decode_attention: lora_a must be [R <= {LORA_A_MAX_R}, {H * hd}] of q's dtype, unit "
                         f"last stride; got {tuple(lora_a.shape)} {lora_a.dtype}")
    if lora_a is not None and capturing(q.device) and not lora_buffers_ready(q.device, B, KV, lora_a.shape[0]):
        raise RuntimeError("decode_attention: lora_a's buffers must be made before a CUDA graph capture "
                           "(`lora_buffers_ready`; the engine's eager warm-up makes them)")
    G = H // KV
    span = S if window is None else min(S, int(window))  # slots a row can see: what the splits share
    pps = PROGRAMS_PER_SM
    if block_n is None:
        block_n, pps, stages = choose_tile(B * KV, q.device)
        num_stages = stages if num_stages is None else num_stages
    if splits is None:
        splits, chunk = choose_splits(B * KV, span, block_n, q.device, pps)
    else:
        chunk = triton.cdiv(triton.cdiv(span, splits), block_n) * block_n
        splits = triton.cdiv(span, chunk)
    out = alloc((B, H, hd), q.device, q.dtype)
    direct = splits == 1
    merge = merge or lora_a is not None  # the LoRA A product rides on whichever program writes the output
    part_m = part_l = part_acc = out  # unused by the direct path
    counters = key_valid  # not read without merge
    merge = merge and not direct
    if merge and lora_a is None and not counters_ready(q.device, B, KV) and capturing(q.device):
        merge = False  # its zeroed counters would be made inside the capture: the combine launch instead
    if merge or lora_a is not None:  # int32 zeros per (row, kv head) that every launch leaves at zero (made for a
        # lora_a call on the direct path too, so that one readiness check covers every split count)
        counters = persistent("decode_attention", q.device, (B, KV),
                              lambda: torch.zeros(B * KV, dtype=torch.int32, device=q.device))
    h = ha = cnt2 = counters  # not read without lora_a
    block_r = 16
    if lora_a is not None:
        R = lora_a.shape[0]
        block_r = lora_block(R)
        h = alloc((B, R), q.device, q.dtype)
        ha, cnt2 = persistent("decode_attention_lora_a", q.device, (B, KV, block_r), lambda: (
            alloc((B, KV, block_r), q.device, torch.float32), torch.zeros(B, dtype=torch.int32, device=q.device)))
    if not direct:
        part_m = alloc((B, H, splits), q.device, torch.float32)
        part_l = alloc((B, H, splits), q.device, torch.float32)
        part_acc = alloc((B, H, splits, hd), q.device, torch.float32)
    block_d = triton.next_power_of_2(hd)
    interp = q.device.type != "cuda"
    n_parts, parts_a_load = partial_tiles(KV, block_r) if lora_a is not None else (1, 1)  # 1: one compile
    sink_arg = out if sinks is None else sinks  # not read without sinks
    s_sink = 0 if sinks is None else sinks.stride(0)
    _split_kernel[(B, KV, splits)](
        q, k_cache, v_cache, key_valid.view(torch.uint8), slot, sink_arg, out, part_m, part_l, part_acc,
        k_new, v_new, cos, sin, counters, q if lora_a is None else lora_a, h, ha, cnt2,
        0 if lora_a is None else lora_a.shape[0], 0 if lora_a is None else lora_a.stride(0), h.stride(0),
        S, H, G, hd, chunk, splits, 0 if window is None else int(window), float(scale) * LOG2E, max_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), key_valid.stride(0), out.stride(0), out.stride(1),
        0 if slot.numel() == 1 else slot.stride(0), s_sink,
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0),
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, BLOCK_D=block_d, DIRECT=direct,
        HAS_WINDOW=window is not None, HAS_SINK=sinks is not None, ROPE=rope is not None, HALF=hd // 2,
        INTERP=interp, MERGE=merge, BLOCK_S=triton.next_power_of_2(splits) if merge else 1,  # 1: one compile
        LORA_A=lora_a is not None, BLOCK_R=block_r, NP=n_parts, NC=parts_a_load,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}), **pdl.launch_options(q))
    if not direct and not merge:
        _combine_kernel[(B * H,)](part_m, part_l, part_acc, sink_arg, out, H, hd, splits, out.stride(0),
                                  out.stride(1), s_sink, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
                                  HAS_SINK=sinks is not None, INTERP=interp, num_warps=4, **pdl.launch_options(q))
    return out if lora_a is None else (out, h)
