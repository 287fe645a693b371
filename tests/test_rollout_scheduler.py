"""The rollout schedulers on tiny random models (CPU, fp32): continuous batching (refill, compaction) against
the static reference and HF generate; a prompt prefilled once per group; draws that follow the sequence,
not the row; forced lengths; stop strings, EOS and AQN under refills; the work counts."""

import pytest
import torch

from qerl.nn.noisy_norm import NoisyNorms
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import SamplingParams

from test_rollout_engine import CharTokenizer, completions, full_forward_logprobs, hf_greedy, prompts_of, tiny_model

GREEDY = SamplingParams(temperature=0)


def grouped(lengths, group, seed=0):
    """Prompts of the given lengths, each repeated `group` times in a row (a GRPO batch)."""
    return [p for p in prompts_of(lengths, seed=seed) for _ in range(group)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_equal_under_both_schedulers_and_hf_with_refills(kind):
    """Width 4 for 10 sequences of ragged lengths: the continuous scheduler refills rows mid-decode (its
    prefill lands at a later step than its neighbours') and compacts at the end; every completion equals HF's
    greedy one and the static scheduler's."""
    model = tiny_model(kind)
    prompts = prompts_of([5, 9, 3, 7, 1, 12, 4, 6, 2, 8], seed=2)
    lengths = [3, 17, 5, 20, 9, 1, 14, 6, 11, 2]
    ref = [r[:n] for r, n in zip(hf_greedy(model, prompts, 20), lengths)]
    outs = {}
    for mode in ("static", "continuous"):
        engine = RolloutEngine(model, max_seq_len=64, check_every=4, max_batch=4, scheduler=mode)
        out = engine.generate(prompts, 20, GREEDY, force_lengths=lengths)
        outs[mode] = out
        assert completions(out) == ref, mode
        assert out.completion_mask.sum(1).tolist() == lengths
        assert out.finish_reason == ["length"] * len(prompts)
        lp, ent = full_forward_logprobs(model, out, 1.0)
        torch.testing.assert_close(out.logprobs, lp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.entropies, ent, atol=1e-4, rtol=1e-4)
    # refilling freed rows computes fewer row-steps than waiting for each pass's longest row
    assert outs["continuous"].stats["decoded_row_steps"] < outs["static"].stats["decoded_row_steps"]
    assert outs["continuous"].stats["kept_tokens"] == outs["static"].stats["kept_tokens"] == sum(lengths)


def test_sampled_tokens_follow_the_sequence_not_the_row():
    """Same seed: each sequence draws the same tokens whatever its row, batch width or scheduler (draws keyed
    by (seed, sequence, position)); another seed differs; identical prompts still sample independently."""
    model = tiny_model("qwen3")
    prompts = grouped([5, 9, 3, 7], group=3, seed=1)
    sp = SamplingParams(temperature=1.0)
    runs = []
    for mode, width in [("static", None), ("continuous", None), ("continuous", 4), ("static", 2)]:
        engine = RolloutEngine(model, max_seq_len=64, check_every=3, max_batch=width, scheduler=mode, eos_token_id=7)
        runs.append(completions(engine.generate(prompts, 16, sp, seed=5)))
    assert all(r == runs[0] for r in runs[1:])
    other = RolloutEngine(model, max_seq_len=64, eos_token_id=7).generate(prompts, 16, sp, seed=6)
    assert completions(other) != runs[0]
    assert len({tuple(r) for r in runs[0][:3]}) > 1


def test_each_prompt_is_prefilled_once_per_group():
    """A group's G rows share one prefill row (its k/v copied into each), with the same completions as
    prefilling every row (distinct prompts that happen to be equal are the same thing). A group split over
    refills copies the k/v of a row still holding it instead of prefilling again."""
    model = tiny_model("llama")
    prompts = grouped([6, 4, 9], group=4, seed=3)
    engine = RolloutEngine(model, max_seq_len=64, check_every=4)
    out = engine.generate(prompts, 10, GREEDY, ignore_eos=True)
    assert out.stats["prefill_rows"] == 3
    assert completions(out) == hf_greedy(model, prompts, 10)
    # width 8, ragged lengths: group 1 starts in the first batch and finishes in refills
    lengths = [2, 9, 9, 9, 3, 9, 9, 9, 4, 5, 6, 7]
    split = RolloutEngine(model, max_seq_len=64, check_every=2, max_batch=8).generate(
        prompts, 10, GREEDY, force_lengths=lengths)
    assert split.stats["prefill_rows"] == 3
    assert completions(split) == [r[:n] for r, n in zip(hf_greedy(model, prompts, 10), lengths)]


def test_eos_and_stop_strings_under_refills():
    """EOS ends a row (which is then refilled) and a stop string cuts exactly after its completing token,
    with a queue longer than the width."""
    model = tiny_model("qwen2")
    tok = CharTokenizer()
    prompts = prompts_of([6, 4, 8, 3, 5, 7, 2, 9], seed=9)
    free = completions(RolloutEngine(model, tokenizer=tok, max_seq_len=64).generate(
        prompts, 24, GREEDY, ignore_eos=True))
    stop = tok.decode(free[0][9:11])
    eos = free[1][5]
    engine = RolloutEngine(model, tokenizer=tok, max_seq_len=64, check_every=4, max_batch=2, eos_token_id=eos)
    out = engine.generate(prompts, 24, GREEDY, stop=[stop])
    for row, full, reason in zip(completions(out), free, out.finish_reason):
        end = len(full)
        if eos in full:
            end = full.index(eos) + 1
        text_end = next((k for k in range(1, end + 1) if stop in tok.decode(full[:k])), None)
        if text_end is not None and text_end <= end:
            end = text_end
        assert row == full[:end]
        assert reason == ("stop" if end < len(full) or (eos in full and full.index(eos) + 1 == end) else "length")
    assert len(completions(out)[0]) <= 11


def test_aqn_noise_applies_under_refills_and_is_restored():
    """AQN under the continuous scheduler with refills: the noisy policy samples differently, per-forward
    redraws work, and the norm weights are exactly restored afterwards."""
    model = tiny_model("llama")
    prompts = grouped([5, 7, 3], group=2, seed=4)
    engine = RolloutEngine(model, max_seq_len=64, check_every=2, max_batch=2)
    before = [p.clone() for p in model.parameters()]
    clean = engine.generate(prompts, 12, GREEDY, ignore_eos=True)
    for per_forward in (False, True):
        noisy = engine.generate(prompts, 12, GREEDY, ignore_eos=True,
                                aqn=NoisyNorms(model, 0.5, per_forward=per_forward, seed=0))
        assert completions(noisy) != completions(clean)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_forced_lengths_are_checked():
    engine = RolloutEngine(tiny_model("llama"), max_seq_len=64)
    with pytest.raises(ValueError, match="force_lengths"):
        engine.generate(prompts_of([3, 4]), 8, GREEDY, force_lengths=[3])
    with pytest.raises(ValueError, match="force_lengths"):
        engine.generate(prompts_of([3, 4]), 8, GREEDY, force_lengths=[3, 9])
    with pytest.raises(ValueError, match="scheduler"):
        RolloutEngine(tiny_model("llama"), scheduler="dynamic")


def test_compaction_moves_rows_without_changing_them():
    """All 64 rows fit at once (no refill); most stop early, so the survivors are compacted into narrower
    batches twice: their completions and log-probs are unchanged, and fewer row-steps are computed."""
    model = tiny_model("qwen3")
    prompts = prompts_of([4, 6, 3, 8, 5, 7, 2, 9] * 8, seed=6)
    lengths = [2, 3, 4, 1] * 11 + [5, 6, 7, 8] * 4 + [30, 30, 30, 40]
    outs = {mode: RolloutEngine(model, max_seq_len=64, check_every=4, scheduler=mode).generate(
        prompts, 40, SamplingParams(temperature=0.9), seed=1, force_lengths=lengths)
        for mode in ("static", "continuous")}
    assert completions(outs["static"]) == completions(outs["continuous"])
    torch.testing.assert_close(outs["static"].logprobs, outs["continuous"].logprobs, atol=1e-5, rtol=1e-5)
    # static: 64 rows x 40 steps. continuous, checks every 4 steps: 64 rows to the first check (20 live: 32
    # rows), 32 to the second (4 live: 8 rows, the narrowest width), then 8 until the end
    assert outs["static"].stats["decoded_row_steps"] == 64 * 40
    assert outs["continuous"].stats["decoded_row_steps"] == 64 * 4 + 32 * 4 + 8 * 32
