"""Rollout engine on tiny random Llama/Qwen2/Qwen3 models (CPU, fp32): greedy == HF generate, recorded
log-probs == a full forward, left-padded batches == one prompt at a time, EOS and stop strings, seeds."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from qerl.nn import LoraConfig, QuantLinear
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":  # tied embeddings, like SmolLM2
        cfg = LlamaConfig(**COMMON, tie_word_embeddings=True, rope_theta=100000.0)
    elif kind == "qwen2":  # q/k/v bias
        cfg = Qwen2Config(**COMMON, tie_word_embeddings=False)
    else:  # q_norm/k_norm, head_dim != hidden / heads
        cfg = Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()
    with torch.no_grad():  # HF init is small and tame; larger weights give peakier, more distinctive outputs
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return model


def quantize_tiny(model: torch.nn.Module, fmt: str = "nvfp4", r: int = 4, seed: int = 1) -> torch.nn.Module:
    """Swap every target linear for a QuantLinear with a non-zero LoRA (B random, so the adapter matters)."""
    g = torch.Generator().manual_seed(seed)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            q = QuantLinear.from_linear(mod, fmt, LoraConfig(r=r, alpha=2 * r))
            with torch.no_grad():
                q.lora_B.weight.copy_(torch.randn(q.lora_B.weight.shape, generator=g) * 0.05)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, q)
    return model


def prompts_of(lengths, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompts, max_new, eos=None):
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         pad_token_id=0, eos_token_id=eos)
    rows = []
    for r in out[:, P:].tolist():
        if eos is not None and eos in r:
            r = r[: r.index(eos) + 1]
        rows.append(r)
    return rows


def completions(rollout):
    return [t[m].tolist() for t, m in zip(rollout.completion_ids, rollout.completion_mask)]


def full_forward_logprobs(model, rollout, temperature):
    """log softmax(logits / T) of each completion token from one HF forward over prompt + completion."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).long()
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    P = rollout.prompt_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1:-1] / temperature, -1)
    tok_lp = lp.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    return tok_lp * rollout.completion_mask, ent * rollout.completion_mask


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_generate(kind):
    model = tiny_model(kind)
    prompts = prompts_of([5, 9, 3, 12])
    engine = RolloutEngine(model, max_seq_len=64)
    out = engine.generate(prompts, 20, SamplingParams(temperature=0), ignore_eos=True)
    assert out.completion_ids.shape == (4, 20)
    assert completions(out) == hf_greedy(model, prompts, 20)


def test_greedy_matches_hf_generate_quantized_lora():
    """NVFP4 base + non-zero LoRA: the engine's own LoRA path == the modules' forward under HF generate."""
    model = quantize_tiny(tiny_model("qwen2"))
    prompts = prompts_of([4, 11, 7], seed=3)
    engine = RolloutEngine(model, max_seq_len=64)
    out = engine.generate(prompts, 16, SamplingParams(temperature=0), ignore_eos=True)
    assert completions(out) == hf_greedy(model, prompts, 16)


def test_lora_update_is_what_samples_next():
    """Update the adapter in place (as an optimizer does) and the very next generate follows it."""
    model = quantize_tiny(tiny_model("llama"))
    engine = RolloutEngine(model, max_seq_len=64)
    prompts = prompts_of([6, 8], seed=5)
    before = completions(engine.generate(prompts, 12, SamplingParams(temperature=0), ignore_eos=True))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.lora_B.weight.mul_(-20.0)
    after = completions(engine.generate(prompts, 12, SamplingParams(temperature=0), ignore_eos=True))
    assert after == hf_greedy(model, prompts, 12)
    assert after != before
    for m in model.modules():  # LoRA switched off (the reference policy) is honoured too
        if isinstance(m, QuantLinear):
            m.lora_enabled = False
    off = completions(engine.generate(prompts, 12, SamplingParams(temperature=0), ignore_eos=True))
    assert off == hf_greedy(model, prompts, 12)
    assert off != after


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_sampled_logprobs_match_full_forward(kind):
    model = quantize_tiny(tiny_model(kind)) if kind == "qwen3" else tiny_model(kind)
    engine = RolloutEngine(model, max_seq_len=64)
    sp = SamplingParams(temperature=0.7, top_k=40, top_p=0.95)
    out = engine.generate(prompts_of([3, 10, 6], seed=7), 24, sp, seed=0, ignore_eos=True)
    ref_lp, ref_ent = full_forward_logprobs(model, out, 0.7)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(out.entropies, ref_ent, atol=2e-4, rtol=1e-4)
    assert (out.entropies[out.completion_mask] > 0).all()


def test_left_padded_batch_equals_one_prompt_at_a_time():
    model = tiny_model("qwen3")
    engine = RolloutEngine(model, max_seq_len=64)
    prompts = prompts_of([2, 13, 7, 1, 9], seed=11)
    batch = engine.generate(prompts, 10, SamplingParams(temperature=0), ignore_eos=True)
    for i, p in enumerate(prompts):
        alone = engine.generate([p], 10, SamplingParams(temperature=0), ignore_eos=True)
        assert completions(alone)[0] == completions(batch)[i]
        torch.testing.assert_close(alone.logprobs[0], batch.logprobs[i], atol=1e-5, rtol=1e-5)


def test_batch_split_into_passes_equals_one_pass():
    """max_batch=2 runs 5 rows as passes of 2, 2, 1 (different prompt widths and early stops per pass);
    the concatenated rollout equals the one-pass rollout row for row, padding included."""
    model = tiny_model("qwen2")
    prompts = prompts_of([2, 13, 7, 1, 9], seed=3)
    one = RolloutEngine(model, max_seq_len=64).generate(prompts, 10, SamplingParams(temperature=0))
    split_engine = RolloutEngine(model, max_seq_len=64, max_batch=2)
    assert split_engine.rows_per_pass(5, 23) == 2
    split = split_engine.generate(prompts, 10, SamplingParams(temperature=0))
    assert completions(split) == completions(one)
    assert split.finish_reason == one.finish_reason
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(getattr(split, name), getattr(one, name)), name
    torch.testing.assert_close(split.logprobs, one.logprobs, atol=1e-5, rtol=1e-5)


def test_rows_per_pass_sized_from_free_memory():
    """The pass size follows the memory a cache may use (CUDA's free memory; given here), in batch buckets,
    never allocating a bucket larger than what fits; not even one row is a clear out-of-memory error."""
    engine = RolloutEngine(tiny_model("llama"), max_seq_len=64, memory_fraction=1.0)
    row = engine._bytes_per_row()
    assert row == 2 * 2 * 2 * 16 * 64 * 4 + 96 * (4 + 12)  # k+v, 2 layers, 2 kv heads x 16, fp32; + logits
    engine._free_bytes = lambda: 45 * row
    assert engine.rows_per_pass(32, 20) == 32
    assert engine.rows_per_pass(40, 20) == 32  # 40 rows would allocate the 64-row bucket
    assert engine.rows_per_pass(300, 20) == 32
    engine._free_bytes = lambda: row // 2
    with pytest.raises(torch.OutOfMemoryError, match="not even one row"):
        engine.rows_per_pass(4, 20)
    engine._free_bytes = lambda: None  # CPU: never split
    assert engine.rows_per_pass(300, 20) == 300


def test_release_memory_then_generate_again():
    model = tiny_model("llama")
    engine = RolloutEngine(model, max_seq_len=64)
    prompts = prompts_of([4, 9, 3], seed=5)
    a = engine.generate(prompts, 8, SamplingParams(temperature=0), ignore_eos=True)
    assert engine.release_memory() > 0 and engine.cache is None
    b = engine.generate(prompts, 8, SamplingParams(temperature=0), ignore_eos=True)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_right_padded_tensor_input_is_accepted():
    model = tiny_model("llama")
    engine = RolloutEngine(model, max_seq_len=64)
    prompts = prompts_of([4, 9], seed=2)
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    a = engine.generate(ids, 8, SamplingParams(temperature=0), attention_mask=mask, ignore_eos=True)
    b = engine.generate(prompts, 8, SamplingParams(temperature=0), ignore_eos=True)
    assert completions(a) == completions(b)
    assert a.prompt_mask.sum(1).tolist() == [4, 9]


def test_eos_stops_each_row_and_matches_hf():
    model = tiny_model("llama")
    prompts = prompts_of([5, 8, 3], seed=4)
    free = completions(RolloutEngine(model, max_seq_len=64).generate(
        prompts, 16, SamplingParams(temperature=0), ignore_eos=True))
    eos = free[0][6]  # a token row 0 emits, so at least one row stops early
    engine = RolloutEngine(model, max_seq_len=64, eos_token_id=eos, check_every=4)
    out = engine.generate(prompts, 16, SamplingParams(temperature=0))
    got = completions(out)
    assert got == hf_greedy(model, prompts, 16, eos=eos)
    for row, full, reason in zip(got, free, out.finish_reason):
        if eos in full:
            assert row == full[: full.index(eos) + 1] and reason == "stop"
        else:
            assert row == full and reason == "length"
    assert (out.logprobs[~out.completion_mask] == 0).all()
    assert (out.completion_ids[~out.completion_mask] == 0).all()


class CharTokenizer:
    """Offline stand-in: token i decodes to one printable character."""
    pad_token_id, eos_token_id = 0, None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(33 + i % 90) for i in ids)


def test_stop_strings_cut_after_the_completing_token():
    model = tiny_model("qwen2")
    tok = CharTokenizer()
    prompts = prompts_of([6, 4], seed=9)
    free = RolloutEngine(model, tokenizer=tok, max_seq_len=64).generate(
        prompts, 24, SamplingParams(temperature=0), ignore_eos=True)
    free_rows = completions(free)
    stop = tok.decode(free_rows[0][9:11])  # two characters row 0 writes at tokens 9-10
    engine = RolloutEngine(model, tokenizer=tok, max_seq_len=64, check_every=8)
    out = engine.generate(prompts, 24, SamplingParams(temperature=0), stop=[stop], ignore_eos=True)
    for row, full, text, reason in zip(completions(out), free_rows, out.texts, out.finish_reason):
        assert row == full[: len(row)]  # a prefix of the unstopped completion
        if stop in tok.decode(full):
            assert stop in tok.decode(row) and stop not in tok.decode(row[:-1]) and reason == "stop"
            assert text == tok.decode(row)
        else:
            assert row == full and reason == "length"
    assert len(completions(out)[0]) <= 11


def test_seeds_reproduce_and_differ():
    model = tiny_model("llama")
    engine = RolloutEngine(model, max_seq_len=64)
    sp = SamplingParams(temperature=1.0)
    p = prompts_of([5, 5, 5, 5], seed=1)
    a = engine.generate(p, 12, sp, seed=123, ignore_eos=True)
    b = engine.generate(p, 12, sp, seed=123, ignore_eos=True)
    c = engine.generate(p, 12, sp, seed=124, ignore_eos=True)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # identical prompts in one batch still get independent samples
    assert len({tuple(r) for r in completions(a)}) > 1


def test_too_long_is_refused_and_unknown_arch_named():
    engine = RolloutEngine(tiny_model("llama"), max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate(prompts_of([10]), 8)


@pytest.mark.slow
def test_greedy_matches_hf_generate_on_smollm2():
    pretrained = pytest.importorskip("qerl.models.pretrained")
    model, tok = pretrained.load_causal_lm("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    msgs = ["What is 7 times 8?", "Say hello in French.", "List three fruits."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                       tokenize=True) for m in msgs]
    prompts = [p if isinstance(p[0], int) else p["input_ids"] for p in prompts]
    engine = RolloutEngine(model, tokenizer=tok, max_seq_len=256)
    out = engine.generate(prompts, 32, SamplingParams(temperature=0), ignore_eos=True)
    assert completions(out) == hf_greedy(model, prompts, 32)
