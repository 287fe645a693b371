"""One launch per decode step for drawing the next tokens: softmax statistics, the draw, and the record.

The eager sampler (`qerl.rollout.sampling.next_token`) is ~12 kernels per step, several of them full
fp32 passes over the [B, V] logits (the cast, log_softmax, exp, the exponential draws, log, ...), plus ~12
small launches for the engine's bookkeeping (at V = 152064 a visible part of a 7B decode step; see
`python -m qerl.bench.decode_profile`). This kernel reads the logits
twice (the second time mostly from cache) and writes only the per-row results.

Grid (B, NC): program (b, c) takes the slice [c CHUNK, (c + 1) CHUNK) of row b, z = logits / T in fp32:
  pass 1: the slice max M_c;
  pass 2: s_c = sum exp(z - M_c), t_c = sum exp(z - M_c) z, and the draw: key = z - log E with
          E = -log U ~ Exp(1), U = Philox(seed, offset + b V + v) (the exponential race: argmax of the keys
          is a sample of softmax(z); greedy: key = z). The slice's best key and its smallest index.
Then it stores its partial and takes a ticket from row b's arrival counter (the protocol of
`lora_a`: CTA barrier, acq_rel atomic, .cg loads). The last program of the row combines the NC
partials in chunk order (a fixed order, so the result does not depend on which program came last):
  lse = M + log(sum_c s_c e^(M_c - M)), entropy = lse - sum_c t_c e^(M_c - M) / sum_c s_c e^(M_c - M),
  token = the best key's smallest index (torch.argmax's tie rule), logprob = z[token] - lse,
writes them and resets the counter. RECORD adds the engine's per-step bookkeeping for row b: the token
column (pad once the row is done), mask, logprob and entropy columns (0 once done), the row's done flag
(| token in eos) and the next step's input token.

Same distribution and statistics as the eager sampler (fp32 throughout; the draws come from a different
random stream). This module imports Triton: import it lazily.
"""

import torch
import triton
import triton.language as tl


from ..route import sm_count
from ..workspace import alloc, counters

BLOCK = 2048  # elements per loop step of a program (8 warps: 8 per thread)
MIN_CHUNK = 4096  # a program takes at least this many elements of a row
CPU_SMS = 2


# Arguments that change from step to step are not specialized on (value 1, divisibility by 16, 16-byte
# alignment of the record columns): each new combination would compile the kernel again, mid-rollout
@triton.jit(do_not_specialize=["seed", "step", "stride_o", "n_eos", "pad_id"],
            do_not_specialize_on_alignment=["otok_ptr", "omask_ptr", "olp_ptr", "oent_ptr"])
def _sample_kernel(logits_ptr, stride_l, V, inv_t, seed, step, key_ptr, mpart_ptr, ipart_ptr, cnt_ptr,
                   tok_ptr, lp_ptr, ent_ptr,
                   done_ptr, eos_ptr, n_eos, pad_id, otok_ptr, omask_ptr, olp_ptr, oent_ptr, stride_o, step_ptr,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr, NCP: tl.constexpr, EP: tl.constexpr,
                   GREEDY: tl.constexpr, RECORD: tl.constexpr, ROW_KEYS: tl.constexpr):
    """logits [B, V] (16-bit or fp32, row stride stride_l, unit column stride) -> tok int64 [B], lp and ent
    fp32 [B]. mpart fp32 [B, NC, 4] and ipart int32 [B, NC]: partials; cnt int32 [B] zeros (left zero).
    RECORD: done bool [B] (read, then or-ed with "token in eos[:n_eos]", int64), otok int64 / omask bool /
    olp, oent fp32 columns [B] with row stride stride_o, step int64 [B] (the next input token).
    seed int64 (>= 2^32, so its type never changes); draw (b, v) of step `step` uses Philox offset
    (step B + b) V + v, or with ROW_KEYS (key[b] + step) V + v, key int64 [B]."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    nc = tl.num_programs(1)
    row = logits_ptr + b.to(tl.int64) * stride_l
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    offs = tl.arange(0, BLOCK)
    if ROW_KEYS:  # the row's own counter: its draws do not depend on the batch it runs in
        draw0 = (tl.load(key_ptr + b) + step.to(tl.int64)) * V
    else:
        draw0 = (step.to(tl.int64) * tl.num_programs(0) + b) * V  # this row's Philox offsets start here

    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, CHUNK, BLOCK):  # constant trip count; past V everything is masked
        idx = lo + start + offs
        z = tl.load(row + idx, mask=idx < hi, other=float("-inf")).to(tl.float32) * inv_t
        mx = tl.maximum(mx, z)
    m_c = tl.max(mx, 0)
    m_safe = tl.where(m_c == float("-inf"), 0.0, m_c)  # an all -inf slice: every exp below is 0

    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, CHUNK, BLOCK):
        idx = lo + start + offs
        inside = idx < hi
        z = tl.load(row + idx, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        e = tl.exp(z - m_safe)
        s += e
        t += e * tl.where(e > 0, z, 0.0)  # 0 * -inf would be nan
        if GREEDY:
            key = z
        else:
            u = tl.rand(seed, draw0 + idx)
            key = z - tl.log(tl.maximum(-tl.log(u), 1e-30))  # z - log E, E = -log U ~ Exp(1)
        key = tl.where(inside, key, float("-inf"))
        take = key > best  # strict: a lane's earlier (smaller) index wins a tie
        best = tl.where(take, key, best)
        best_i = tl.where(take, idx, best_i)
    bk = tl.max(best, 0)
    bi = tl.min(tl.where(best == bk, best_i, 2147483647), 0)

    part = mpart_ptr + (b * nc + c) * 4
    tl.store(part + tl.arange(0, 4), tl.where(tl.arange(0, 4) == 0, m_c,
                                              tl.where(tl.arange(0, 4) == 1, tl.sum(s, 0),
                                                       tl.where(tl.arange(0, 4) == 2, tl.sum(t, 0), bk))))
    tl.store(ipart_ptr + b * nc + c, bi)
    tl.debug_barrier()  # every thread's stores before the (single-thread) release
    ticket = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
    if ticket == nc - 1:
        cs = tl.arange(0, NCP)
        live = cs < nc
        pr = mpart_ptr + (b * nc + cs) * 4
        m_all = tl.load(pr, mask=live, other=float("-inf"), cache_modifier=".cg")
        s_all = tl.load(pr + 1, mask=live, other=0.0, cache_modifier=".cg")
        t_all = tl.load(pr + 2, mask=live, other=0.0, cache_modifier=".cg")
        k_all = tl.load(pr + 3, mask=live, other=float("-inf"), cache_modifier=".cg")
        i_all = tl.load(ipart_ptr + b * nc + cs, mask=live, other=2147483647, cache_modifier=".cg")
        m = tl.max(m_all, 0)
        m0 = tl.where(m == float("-inf"), 0.0, m)
        w = tl.where(m_all == float("-inf"), 0.0, tl.exp(m_all - m0))
        s_tot = tl.sum(s_all * w, 0)
        t_tot = tl.sum(t_all * w, 0)
        lse = m0 + tl.log(s_tot)
        kbest = tl.max(k_all, 0)
        tok = tl.min(tl.where(k_all == kbest, i_all, 2147483647), 0)
        tok = tl.where(tok < V, tok, 0)  # no finite key at all (an all -inf row): token 0, as argmax gives
        z_tok = tl.load(row + tok).to(tl.float32) * inv_t
        lp = z_tok - lse
        ent = lse - t_tot / s_tot
        tok64 = tok.to(tl.int64)
        tl.store(tok_ptr + b, tok64)
        tl.store(lp_ptr + b, lp)
        tl.store(ent_ptr + b, ent)
        if RECORD:
            was_done = tl.load(done_ptr + b) != 0
            es = tl.arange(0, EP)
            eos = tl.load(eos_ptr + es, mask=es < n_eos, other=-1)
            hit = tl.sum((eos == tok64).to(tl.int32), 0) > 0
            o = b.to(tl.int64) * stride_o
            tl.store(otok_ptr + o, tl.where(was_done, pad_id, tok64))
            tl.store(omask_ptr + o, (~was_done).to(tl.int1))
            tl.store(olp_ptr + o, tl.where(was_done, 0.0, lp))
            tl.store(oent_ptr + o, tl.where(was_done, 0.0, ent))
            tl.store(done_ptr + b, (was_done | hit).to(tl.int1))
            tl.store(step_ptr + b, tok64)
        tl.store(cnt_ptr + b, 0)  # every program of the row has arrived: ready for the next launch


def _sm_count(device: torch.device) -> int:
    return sm_count(device, CPU_SMS)


def chunks_for(B: int, V: int, device: torch.device) -> int:
    """Programs per row: about two programs per SM over the batch, each at least MIN_CHUNK elements."""
    return max(1, min(-(-2 * _sm_count(device) // B), -(-V // MIN_CHUNK)))


def row_counters(device: torch.device, B: int) -> torch.Tensor:
    """int32 [B] arrival counters, kept for the process; every launch leaves them at zero."""
    return counters("sampling", device, B)


def sample_triton(logits: torch.Tensor, temperature: float, seed: int, step: int, record: dict | None = None,
                  chunks: int | None = None, row_keys: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] (unit column stride) -> (tokens int64 [B], logprob fp32 [B], entropy fp32 [B]) under
    softmax(logits / T) (T = 1 and the argmax when temperature == 0). The draw for element (b, v) uses
    Philox(seed, (step B + b) V + v), seed in [2^32, 2^62): give each step of a rollout its own `step`.
    row_keys int64 [B] (contiguous, on the device): the draw uses Philox(seed, (row_keys[b] + step) V + v)
    instead, so a row's stream follows its own key and not its index in the batch (the engine passes
    key = sequence index * 2^20 - the step the sequence started at: `sampling.draw_keys`).
    record: dict(done, eos, pad_id, tokens, mask, logprobs, entropies, step_tokens) of the engine's per-step
    bookkeeping (see the module docstring): done bool [B] contiguous (updated in place), eos int64 [E],
    the columns tokens int64 / mask bool / logprobs, entropies fp32, each [B] with one row stride,
    step_tokens int64 [B]. `chunks` overrides the programs per row (tests). The row counters are
    shared by the calls of one batch size on one stream (each call leaves them at zero)."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and B >= 1 and V >= 1
    if not 2**32 <= seed < 2**62 or not 0 <= step < 2**31:
        raise ValueError(f"seed must be in [2^32, 2^62) and step in [0, 2^31), got {seed}, {step}")
    dev = logits.device
    nc = chunks or chunks_for(B, V, dev)
    chunk = triton.cdiv(triton.cdiv(V, nc), BLOCK) * BLOCK
    nc = triton.cdiv(V, chunk)
    mpart = alloc((B, nc, 4), dev, torch.float32)
    ipart = alloc((B, nc), dev, torch.int32)
    tok = alloc((B,), dev, torch.int64)
    lp = alloc((B,), dev, torch.float32)
    ent = alloc((B,), dev, torch.float32)
    greedy = temperature == 0
    if record is None:
        rec = dict(done=tok, eos=tok, n_eos=0, pad_id=0, tokens=tok, mask=tok, logprobs=lp, entropies=ent,
                   stride=0, step_tokens=tok)
    else:
        cols = (record["tokens"], record["mask"], record["logprobs"], record["entropies"])
        stride = cols[0].stride(0)
        want = (torch.int64, torch.bool, torch.float32, torch.float32)
        if not all(c.shape == (B,) and c.stride(0) == stride and c.dtype == d for c, d in zip(cols, want)):
            raise ValueError("record columns must be [B] with one row stride: tokens int64, mask bool, "
                             "logprobs and entropies fp32")
        done, step_tokens = record["done"], record["step_tokens"]
        eos = record["eos"]
        if done.shape != (B,) or not done.is_contiguous() or done.dtype != torch.bool or \
                step_tokens.shape != (B,) or not step_tokens.is_contiguous() or step_tokens.dtype != torch.int64 or \
                eos.dtype != torch.int64 or eos.dim() != 1 or not eos.is_contiguous():
            raise ValueError("record: done must be bool [B], step_tokens int64 [B] and eos int64 [E], contiguous")
        n_eos = record["eos"].numel()
        rec = dict(record, n_eos=n_eos, stride=stride, eos=record["eos"] if n_eos else tok)  # tok: never read
    if row_keys is not None and (row_keys.shape != (B,) or row_keys.dtype != torch.int64
                                 or not row_keys.is_contiguous() or row_keys.device != dev):
        raise ValueError("row_keys must be a contiguous int64 [B] tensor on the logits' device")
    _sample_kernel[(B, nc)](
        logits, logits.stride(0), V, 1.0 if greedy else 1.0 / temperature, seed, step,
        tok if row_keys is None else row_keys, mpart, ipart,
        row_counters(dev, B), tok, lp, ent,
        rec["done"], rec["eos"], rec["n_eos"], rec["pad_id"], rec["tokens"], rec["mask"], rec["logprobs"],
        rec["entropies"], rec["stride"], rec["step_tokens"],
        CHUNK=chunk, BLOCK=BLOCK, NCP=triton.next_power_of_2(nc), EP=max(2, triton.next_power_of_2(rec["n_eos"])),
        GREEDY=greedy, RECORD=record is not None, ROW_KEYS=row_keys is not None, num_warps=8)
    return tok, lp, ent
