"""The one-launch sampler (`qerl.kernels.triton.sampling`) against float64 torch references.

Checked on fresh random logits, with NaN-poisoned outputs and partials: the log-prob of the drawn token and
the entropy of softmax(logits / T) (one fp32 pass, so within ~1e-5 of float64), greedy tokens equal to
torch.argmax (first index on ties, also across the programs of a row), the frequencies of many draws
against the softmax probabilities, the same draws for the same (seed, offset), the engine's bookkeeping
(pad / mask / zeros once a row is done, the done flag from the eos list, the next input token) and the
arrival counters left at zero. Rows are strided slices of a wider matrix and hold -inf (masked tokens),
ties and large values. Runs on the CPU through the Triton interpreter and on the GPU (marked gpu).
"""

import math

import pytest
import torch

from kernel_testing import require_cuda, run_interpreter_suite

from qerl.kernels.workspace import poisoned_outputs

# (B, V, temperature, chunks, dtype, variant): chunks None = the automatic choice
CASES = [
    (3, 5000, 1.0, None, torch.bfloat16, ""),
    (2, 10000, 0.7, 3, torch.float32, "special"),
    (4, 300, 0.0, None, torch.bfloat16, "ties"),
    (1, 9000, 1.3, 2, torch.float16, "strided"),
    (5, 9000, 0.0, 3, torch.float32, "ties"),
    (7, 2049, 1.0, 2, torch.bfloat16, "special"),
]


def _logits(B, V, dtype, variant, gen, device):
    wide = torch.randn(B, V + 13, generator=gen, device=device) * 3
    if variant == "special":
        wide[0, : V // 3] = float("-inf")  # masked tokens, a whole first program's slice included
        wide[-1, V // 2] = 80.0  # one token with nearly all the mass
        wide[:, 1] = -1e4
    if variant == "ties":  # the max value at several places, in different programs of the row
        top = wide[:, :V].max(-1, keepdim=True).values + 1
        for j in (V - 1, V // 2, 5):
            wide[:, j: j + 1] = top
    x = wide.to(dtype)
    return x[:, 7: 7 + V] if variant == "strided" else x[:, :V].contiguous()


def _reference(logits, temperature):
    z = logits.double() / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(z, -1)
    p = lp.exp()
    return lp, -(p * lp.masked_fill(p == 0, 0.0)).sum(-1)


def check_statistics(device, cases=CASES, seed=0) -> list[str]:
    from qerl.kernels.triton import sampling as ts

    fails = []
    gen = torch.Generator(device=device).manual_seed(seed)
    for B, V, T, chunks, dtype, variant in cases:
        tag = f"sample {device} B={B} V={V} T={T} chunks={chunks} {dtype} {variant or 'plain'}"
        logits = _logits(B, V, dtype, variant, gen, device)
        with poisoned_outputs():
            tok, lp, ent = ts.sample_triton(logits, T, 2**40 + 1234 + B, 99 + V, chunks=chunks)
        ref_lp, ref_ent = _reference(logits, T)
        if tok.dtype != torch.int64 or not ((tok >= 0) & (tok < V)).all():
            fails.append(f"{tag}: tokens {tok.tolist()}")
            continue
        got = ref_lp.gather(1, tok[:, None]).squeeze(1)
        if not torch.isfinite(got).all():
            fails.append(f"{tag}: drew a token of probability 0: {tok.tolist()}")
        for name, a, b in (("logprob", lp, got), ("entropy", ent, ref_ent)):
            err = (a.double() - b).abs().max().item()
            if not (err <= 2e-5 * max(1.0, b.abs().max().item())):  # also false for NaN
                fails.append(f"{tag}: {name} off by {err:.3g}")
        if T == 0 and not torch.equal(tok, logits.float().argmax(-1)):
            fails.append(f"{tag}: greedy {tok.tolist()} != argmax {logits.float().argmax(-1).tolist()}")
        again, _, _ = ts.sample_triton(logits, T, 2**40 + 1234 + B, 99 + V, chunks=chunks)
        if not torch.equal(again, tok):
            fails.append(f"{tag}: the same seed and offset drew different tokens")
        if ts.row_counters(logits.device, B).any():
            fails.append(f"{tag}: arrival counters not reset")
    return fails


def check_distribution(device, rows=(3000, 3000), seed=1, vocab=9000) -> list[str]:
    """Many rows with the same logits: the token frequencies against softmax(z / T), each within 5 sigma
    (rows: for a 6-token and a `vocab`-token vocabulary, the second split over 3 programs per row)."""
    from qerl.kernels.triton import sampling as ts

    fails = []
    cases = ((6, 1.0, None, (0, 3, 5)), (vocab, 0.8, 3, (2, vocab // 2, vocab - 1)))
    for rows, (V, T, chunks, hot) in zip(rows, cases):
        z = torch.full((V,), -30.0)
        z[list(hot)] = torch.tensor([1.0, 0.2, -0.5])
        logits = z.to(device)[None].expand(rows, V).contiguous()
        tok, _, _ = ts.sample_triton(logits, T, 2**33 + 7 + seed, 0, chunks=chunks)
        p = torch.softmax(z.double() / T, -1)
        counts = torch.bincount(tok.cpu(), minlength=V).double()
        for j in hot:
            sd = math.sqrt(rows * p[j] * (1 - p[j]))
            if abs(counts[j] - rows * p[j]) > 5 * sd + 1:
                fails.append(f"distribution V={V}: token {j} drawn {int(counts[j])} times, expected "
                             f"{rows * p[j].item():.0f} +- {sd:.0f}")
        if counts.sum() != rows or counts[[j for j in range(V) if j not in hot]].sum() > 5:
            fails.append(f"distribution V={V}: draws outside the likely tokens")
    return fails


def check_record(device, seed=2) -> list[str]:
    """The engine's bookkeeping, against the eager formulas of `RolloutEngine._generate`."""
    from qerl.kernels.triton import sampling as ts

    gen = torch.Generator(device=device).manual_seed(seed)
    B, V, T, i = 6, 3000, 4, 2
    logits = torch.randn(B, V, generator=gen, device=device).to(torch.bfloat16)
    logits[1, 17] = 50.0  # row 1 draws token 17, an eos id
    done = torch.tensor([False, False, True, False, True, False], device=device)
    eos = torch.tensor([17, 2], device=device)
    out_tokens = torch.full((B, T), -5, dtype=torch.int64, device=device)
    out_mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    out_lp = torch.full((B, T), 9.0, device=device)
    out_ent = torch.full((B, T), 9.0, device=device)
    step = torch.full((B,), -1, dtype=torch.int64, device=device)
    before = done.clone()
    tok, lp, ent = ts.sample_triton(logits, 1.0, 2**32 + 5, 0, record=dict(
        done=done, eos=eos, pad_id=3, tokens=out_tokens[:, i], mask=out_mask[:, i], logprobs=out_lp[:, i],
        entropies=out_ent[:, i], step_tokens=step))
    alive = ~before
    fails = []
    want = dict(tokens=torch.where(alive, tok, 3), mask=alive, lp=torch.where(alive, lp, 0.0),
                ent=torch.where(alive, ent, 0.0), done=before | torch.isin(tok, eos))
    got = dict(tokens=out_tokens[:, i], mask=out_mask[:, i], lp=out_lp[:, i], ent=out_ent[:, i], done=done)
    for k in want:
        if not torch.equal(got[k], want[k]):
            fails.append(f"record {k}: {got[k].tolist()} != {want[k].tolist()}")
    if not torch.equal(step, tok) or tok[1].item() != 17 or not done[1]:
        fails.append(f"record: next tokens {step.tolist()}, drawn {tok.tolist()}, done {done.tolist()}")
    others = [c for c in range(T) if c != i]
    if (out_tokens[:, others] != -5).any() or out_mask[:, others].any() or (out_lp[:, others] != 9).any():
        fails.append("record: wrote outside its column")
    no_eos = torch.zeros(0, dtype=torch.int64, device=device)
    done2 = torch.zeros(B, dtype=torch.bool, device=device)
    ts.sample_triton(logits, 0.0, 2**32, 0, record=dict(
        done=done2, eos=no_eos, pad_id=3, tokens=out_tokens[:, 0], mask=out_mask[:, 0], logprobs=out_lp[:, 0],
        entropies=out_ent[:, 0], step_tokens=step))
    if done2.any() or not out_mask[:, 0].all():
        fails.append("record without eos ids: rows marked done")
    return fails


def check_row_keys(device, seed=3) -> list[str]:
    """Row keys: a row's draw follows its key + step only. The same logits in a permuted batch with the keys
    permuted alike draw the same tokens per row; a row with key k at step s draws what key k + 1 draws at
    step s - 1; distinct keys on identical logits draw differently."""
    from qerl.kernels.triton import sampling as ts

    gen = torch.Generator(device=device).manual_seed(seed)
    B, V = 5, 3000
    logits = torch.randn(B, V, generator=gen, device=device)  # flat enough that different draws differ
    keys = torch.tensor([0, 2**20, 3 * 2**20 - 7, 5, 9 * 2**20], device=device)
    tok, _, _ = ts.sample_triton(logits, 1.0, 2**40 + 3, 11, row_keys=keys)
    perm = torch.tensor([3, 0, 4, 2, 1], device=device)
    tok_p, _, _ = ts.sample_triton(logits[perm].contiguous(), 1.0, 2**40 + 3, 11, row_keys=keys[perm].contiguous())
    shifted, _, _ = ts.sample_triton(logits, 1.0, 2**40 + 3, 10, row_keys=keys + 1)
    same = logits[:1].expand(B, V).contiguous()
    spread, _, _ = ts.sample_triton(same, 1.0, 2**40 + 3, 11, row_keys=keys)
    fails = []
    if not torch.equal(tok_p, tok[perm]):
        fails.append(f"row keys: a permuted batch drew {tok_p.tolist()}, expected {tok[perm].tolist()}")
    if not torch.equal(shifted, tok):
        fails.append(f"row keys: key + 1 at step - 1 drew {shifted.tolist()}, expected {tok.tolist()}")
    if len(set(spread.tolist())) < 3:
        fails.append(f"row keys: distinct keys on one distribution drew {spread.tolist()}")
    return fails


def interpreter_suite() -> list[str]:
    return check_statistics("cpu") + check_distribution("cpu", rows=(800, 150), vocab=3000) + check_record("cpu") + \
        check_row_keys("cpu")


def test_interpreter():
    fails = run_interpreter_suite("test_sampling_kernel", timeout=900)
    assert not fails, "\n".join(fails)


def test_fused_sampling_routing():
    """The engine takes the fused sampler for CUDA logits without top-k / top-p only."""
    from qerl.rollout.sampling import SamplingParams, fused_sampling_applies

    cpu = torch.zeros(2, 10)
    assert not fused_sampling_applies(cpu, SamplingParams(1.0))
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        gpu = cpu.cuda()
        assert fused_sampling_applies(gpu, SamplingParams(0.7))
        assert fused_sampling_applies(gpu, SamplingParams(0.0))
        assert not fused_sampling_applies(gpu, SamplingParams(0.7, top_p=0.9))
        assert not fused_sampling_applies(gpu, SamplingParams(0.7, top_k=5))
        assert not fused_sampling_applies(gpu.t(), SamplingParams(0.7))


@pytest.mark.gpu
def test_gpu():
    require_cuda()
    big = [(B, 152064, T, None, dt, v) for B in (1, 8, 64) for T, dt, v in
           ((1.0, torch.bfloat16, ""), (0.0, torch.bfloat16, "ties"), (0.6, torch.float32, "special"))]
    fails = check_statistics("cuda", CASES + big, seed=3) + check_distribution("cuda", rows=(20000, 20000), seed=4)
    fails += check_record("cuda") + check_row_keys("cuda")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_gpu_steps_of_a_rollout_compile_once(monkeypatch):
    """A rollout's steps differ in step number, seed and the record columns' addresses (alignment): none
    of it may compile the kernel again (a compile costs seconds, mid-rollout)."""
    require_cuda()
    from qerl.kernels.triton import sampling as ts

    B, V, T = 8, 152064, 40
    logits = torch.randn(B, V, device="cuda").to(torch.bfloat16)
    done = torch.zeros(B, dtype=torch.bool, device="cuda")
    eos = torch.tensor([2], device="cuda")
    cols = dict(tokens=torch.zeros(B, T, dtype=torch.int64, device="cuda"),
                mask=torch.zeros(B, T, dtype=torch.bool, device="cuda"),
                logprobs=torch.zeros(B, T, device="cuda"), entropies=torch.zeros(B, T, device="cuda"))
    step_tokens = torch.zeros(B, dtype=torch.int64, device="cuda")

    def run(seed, i):
        ts.sample_triton(logits, 1.0, seed, i, record=dict(done=done, eos=eos, pad_id=0, step_tokens=step_tokens,
                                                           **{k: v[:, i] for k, v in cols.items()}))

    run(2**40, 0)  # compiles (or loads from the cache)
    compiles = []
    real = ts._sample_kernel._do_compile
    monkeypatch.setattr(ts._sample_kernel, "_do_compile", lambda *a, **k: compiles.append(1) or real(*a, **k))
    for seed in (2**40 + 17, 2**61 + 3):
        for i in range(T):
            run(seed, i)
    torch.cuda.synchronize()
    assert not compiles, f"{len(compiles)} recompilations over the steps of a rollout"
