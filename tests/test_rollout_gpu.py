"""The CUDA path of the rollout engine: graph-captured decode == eager decode == HF generate."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from qerl.kernels.route import kernel_policy
from qerl.nn.noisy_norm import NoisyNorms
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.memory import bucket_batch
from qerl.rollout.sampling import SamplingParams

from test_rollout_engine import completions, full_forward_logprobs, hf_greedy, prompts_of, quantize_tiny, tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_cuda_graph_greedy_matches_hf_generate_fp32(kind):
    model = tiny_model(kind).cuda()
    prompts = prompts_of([5, 9, 3, 12, 1], seed=1)
    engine = RolloutEngine(model, max_seq_len=96, kv_block=32)  # several kv buckets in 40 steps
    assert engine.cuda_graphs
    out = engine.generate(prompts, 40, SamplingParams(temperature=0), ignore_eos=True)
    assert completions(out) == hf_greedy(model, prompts, 40)
    assert len(engine.graphs) >= 2


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_cuda_graph_equals_eager_bf16_quantized_lora(fmt):
    model = quantize_tiny(tiny_model("qwen3"), fmt=fmt).cuda().to(torch.bfloat16)
    prompts = prompts_of([7, 2, 11], seed=2)
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    graph = RolloutEngine(model, max_seq_len=96, kv_block=32).generate(prompts, 48, sp, seed=3, ignore_eos=True)
    eager = RolloutEngine(model, max_seq_len=96, kv_block=32, cuda_graphs=False).generate(
        prompts, 48, sp, seed=3, ignore_eos=True)
    assert torch.equal(graph.completion_ids, eager.completion_ids)
    torch.testing.assert_close(graph.logprobs, eager.logprobs, atol=0, rtol=0)
    ref_lp, _ = full_forward_logprobs(model, graph, 0.8)  # bf16 model: loose
    assert (graph.logprobs - ref_lp).abs().mean() < 0.05


def test_graphs_follow_in_place_lora_and_aqn_updates():
    model = quantize_tiny(tiny_model("llama"), fmt="nvfp4").cuda().to(torch.bfloat16)  # Triton path
    engine = RolloutEngine(model, max_seq_len=64)
    prompts = prompts_of([6, 8], seed=5)
    greedy = SamplingParams(temperature=0)
    a = engine.generate(prompts, 16, greedy, ignore_eos=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-20)
    b = engine.generate(prompts, 16, greedy, ignore_eos=True)
    assert completions(b) != completions(a)  # bf16: HF equality is checked in fp32 above
    c = engine.generate(prompts, 16, SamplingParams(temperature=1.0), seed=0, ignore_eos=True,
                        aqn=NoisyNorms(model, 0.1, seed=0))
    d = engine.generate(prompts, 16, SamplingParams(temperature=1.0), seed=0, ignore_eos=True)
    assert not torch.equal(c.logprobs, d.logprobs)
    # switching batch buckets re-captures into a fresh graph pool, and back again
    one = engine.generate(prompts[:1], 16, greedy, ignore_eos=True)
    two = engine.generate(prompts, 16, greedy, ignore_eos=True)
    assert one.completion_mask.all() and completions(two) == completions(b)


PROMPT_LENGTHS = [7, 2, 11, 5, 9, 4, 6, 3, 8, 10, 1, 12]


def gluon_sized_model():
    """A 2-layer Qwen3 with NVFP4 + LoRA linears whose K are multiples of 128 (what the Gluon kernel takes)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return quantize_tiny(model, fmt="nvfp4").cuda().to(torch.bfloat16)


@pytest.mark.parametrize("batch,x_permuted", [(3, None), (12, False), (12, True)])
def test_cuda_graph_equals_eager_through_the_gluon_decode_kernels(batch, x_permuted, monkeypatch):
    """Dimensions the Gluon decode kernel takes (K % 128 == 0), so the engine's decode steps run it: at 3
    prompts (4 rows) its mma.sync form, at 12 prompts (16 rows, sm_90) the wgmma form with x staged or
    pre-permuted (the production default for large weights, forced here on small ones). Graph replay equals
    eager decode token for token and bit for bit, and the recorded log-probs match a full forward."""
    from qerl.kernels.gluon import nvfp4 as gluon_nvfp4

    if batch > 8 and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma form needs sm_90")
    launches = []
    real = gluon_nvfp4.nvfp4_linear_swap

    def recording(x, *args, wgmma=False, **kwargs):
        launches.append((x.shape[0], wgmma))
        return real(x, *args, wgmma=wgmma, **kwargs)

    monkeypatch.setattr(gluon_nvfp4, "nvfp4_linear_swap", recording)
    with kernel_policy(permute_x=x_permuted):  # None: the route's rule
        model = gluon_sized_model()
        prompts = prompts_of(PROMPT_LENGTHS[:batch], seed=4)
        sp = SamplingParams(temperature=0.8, top_p=0.9)
        graph = RolloutEngine(model, max_seq_len=96, kv_block=32).generate(prompts, 40, sp, seed=3, ignore_eos=True)
        rows = bucket_batch(batch)  # the engine pads the batch to its bucket: 4 or 16 rows
        assert (rows, rows > 8) in launches, f"no Gluon launch at {rows} rows: {sorted(set(launches))}"
        eager = RolloutEngine(model, max_seq_len=96, kv_block=32, cuda_graphs=False).generate(
            prompts, 40, sp, seed=3, ignore_eos=True)
        assert torch.equal(graph.completion_ids, eager.completion_ids)
        torch.testing.assert_close(graph.logprobs, eager.logprobs, atol=0, rtol=0)
        ref_lp, _ = full_forward_logprobs(model, graph, 0.8)
        assert not torch.isnan(graph.logprobs).any()
        assert (graph.logprobs - ref_lp).abs().mean() < 0.05


@pytest.mark.parametrize("batch", [3, 12])
def test_programmatic_launches_equal_plain_launches(batch, monkeypatch):
    """Decode with programmatic dependent launch (sm_90+): the chain's kernels (norm, LoRA A, the Gluon
    NVFP4 kernels, RoPE + cache write, attention, SiLU-mul) launch early and wait for their predecessor.
    Same tokens and log-probs, bit for bit, as plain launches, in CUDA graphs and eagerly."""
    from qerl.kernels import pdl

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    early = []
    real = pdl.launch_options

    def recording(x):
        opts = real(x)
        early.append(opts["PDL"])
        return opts

    monkeypatch.setattr(pdl, "launch_options", recording)
    model = gluon_sized_model()
    prompts = prompts_of(PROMPT_LENGTHS[:batch], seed=6)
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    for graphs in (True, False):
        early.clear()
        chained = RolloutEngine(model, max_seq_len=96, kv_block=32, cuda_graphs=graphs, pdl=True).generate(
            prompts, 40, sp, seed=3, ignore_eos=True)
        assert sum(early) >= 7 * 2, "the decode chain did not launch with PDL"  # per layer and step
        plain = RolloutEngine(model, max_seq_len=96, kv_block=32, cuda_graphs=graphs, pdl=False).generate(
            prompts, 40, sp, seed=3, ignore_eos=True)
        assert torch.equal(chained.completion_ids, plain.completion_ids)
        torch.testing.assert_close(chained.logprobs, plain.logprobs, atol=0, rtol=0)
        assert not torch.isnan(chained.logprobs).any()


def test_one_launch_sampler_records_what_a_full_forward_gives():
    """The engine's CUDA sampler (one Triton launch per step, `qerl.kernels.triton.sampling`; T > 0 without
    top-k / top-p) with EOS on: graph == eager bit for bit, a seeded run repeats and another seed differs, the
    recorded log-probs and entropies are those of a full forward (fp32 model), and a row that drew an EOS id
    ends there: mask False and padding after it, finish reason "stop"."""
    model = tiny_model("qwen2").cuda()
    prompts = prompts_of(PROMPT_LENGTHS, seed=8)
    sp = SamplingParams(temperature=0.8)
    eos = [2, 5, 7, 11, 13]  # ~5% of the mass per step: over 48 steps nearly every row stops
    engine = RolloutEngine(model, max_seq_len=96, kv_block=32, eos_token_id=eos)
    a = engine.generate(prompts, 48, sp, seed=3)
    eager = RolloutEngine(model, max_seq_len=96, kv_block=32, eos_token_id=eos, cuda_graphs=False).generate(
        prompts, 48, sp, seed=3)
    assert torch.equal(a.completion_ids, eager.completion_ids)
    assert torch.equal(a.completion_mask, eager.completion_mask)
    torch.testing.assert_close(a.logprobs, eager.logprobs, atol=0, rtol=0)
    assert torch.equal(engine.generate(prompts, 48, sp, seed=3).completion_ids, a.completion_ids)
    assert not torch.equal(engine.generate(prompts, 48, sp, seed=4).completion_ids, a.completion_ids)
    ref_lp, ref_ent = full_forward_logprobs(model, a, 0.8)
    assert (a.logprobs - ref_lp).abs().max() < 1e-3
    assert (a.entropies - ref_ent).abs().max() < 1e-3
    stopped = 0
    for row, (ids, mask) in enumerate(zip(a.completion_ids.tolist(), a.completion_mask.tolist())):
        hits = [j for j, t in enumerate(ids) if t in eos]
        if not hits:
            assert all(mask) and a.finish_reason[row] == "length"
            continue
        stopped += 1
        end = hits[0]
        assert all(mask[: end + 1]) and not any(mask[end + 1:]), f"row {row}: mask does not end at its EOS"
        assert all(t == model.config.pad_token_id for t in ids[end + 1:])
        assert a.finish_reason[row] == "stop"
    assert stopped >= 3, "too few rows drew an EOS id to check the bookkeeping"


def test_plain_bf16_model_decodes_through_the_bf16_kernel(monkeypatch):
    """An unquantized bf16 model: the engine's plain nn.Linear layers and the lm_head take the Gluon bf16 decode
    kernel (`gluon.bf16`) at decode sizes; graph == eager bit for bit, and the sampled log-probs are those of
    HF's own forward (cuBLAS), as closely as bf16 allows."""
    from qerl.kernels.gluon import bf16 as gluon_bf16

    calls = []
    real = gluon_bf16.bf16_linear_swap

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_bf16, "bf16_linear_swap", counting)
    model = tiny_model("qwen2").cuda().to(torch.bfloat16)
    prompts = prompts_of([7, 2, 11, 4], seed=5)
    sp = SamplingParams(temperature=0.8)
    graph = RolloutEngine(model, max_seq_len=96, kv_block=32).generate(prompts, 32, sp, seed=3, ignore_eos=True)
    assert calls and max(calls) <= 32, "the decode steps did not run the bf16 kernel"
    eager = RolloutEngine(model, max_seq_len=96, kv_block=32, cuda_graphs=False).generate(
        prompts, 32, sp, seed=3, ignore_eos=True)
    assert torch.equal(graph.completion_ids, eager.completion_ids)
    torch.testing.assert_close(graph.logprobs, eager.logprobs, atol=0, rtol=0)
    ref_lp, _ = full_forward_logprobs(model, graph, 0.8)
    assert not torch.isnan(graph.logprobs).any()
    assert (graph.logprobs - ref_lp).abs().mean() < 0.05


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_continuous_scheduler_under_cuda_graphs(fmt):
    """The continuous scheduler on the CUDA path (decode graphs, the one-launch sampler with row keys, per-row
    slots in the fused RoPE store and decode attention): refills (width 16 for 24 sequences in groups of 3),
    compaction to 8 rows, and AQN. Graph replay equals eager decode bit for bit; the recorded log-probs match
    a full forward; AQN changes the samples; fewer row-steps than the static scheduler."""
    model = quantize_tiny(tiny_model("qwen3"), fmt=fmt).cuda().to(torch.bfloat16)
    prompts = [p for p in prompts_of([7, 2, 11, 5, 9, 4, 6, 3], seed=2) for _ in range(3)]
    lengths = [3, 40, 9, 17, 1, 33, 25, 6, 12, 40, 2, 20] * 2
    sp = SamplingParams(temperature=0.8)
    kw = dict(max_seq_len=96, kv_block=32, max_batch=16, check_every=4)
    graph_engine = RolloutEngine(model, **kw)
    graph = graph_engine.generate(prompts, 40, sp, seed=3, force_lengths=lengths)
    eager = RolloutEngine(model, cuda_graphs=False, **kw).generate(prompts, 40, sp, seed=3, force_lengths=lengths)
    assert graph.completion_mask.sum(1).tolist() == lengths
    assert {b for b, _ in graph_engine.graphs} == {16, 8}, "no compaction into a narrower batch"
    assert torch.equal(graph.completion_ids, eager.completion_ids)
    torch.testing.assert_close(graph.logprobs, eager.logprobs, atol=0, rtol=0)
    ref_lp, _ = full_forward_logprobs(model, graph, 0.8)
    assert not torch.isnan(graph.logprobs).any()
    assert (graph.logprobs - ref_lp).abs().mean() < 0.05
    assert graph.stats["prefill_rows"] <= 12  # 8 groups; a group split by a refill may be prefilled again
    noisy = graph_engine.generate(prompts, 40, sp, seed=3, force_lengths=lengths, aqn=NoisyNorms(model, 0.1, seed=0))
    assert not torch.equal(noisy.completion_ids, graph.completion_ids)
    static = RolloutEngine(model, scheduler="static", **kw).generate(prompts, 40, sp, seed=3, force_lengths=lengths)
    assert static.stats["decoded_row_steps"] > graph.stats["decoded_row_steps"]


def test_continuous_scheduler_greedy_matches_hf_fp32_with_eos():
    model = tiny_model("llama").cuda()
    prompts = prompts_of(PROMPT_LENGTHS, seed=3)
    free = completions(RolloutEngine(model, max_seq_len=96, kv_block=32).generate(
        prompts, 40, SamplingParams(temperature=0), ignore_eos=True))
    eos = free[0][6]
    engine = RolloutEngine(model, max_seq_len=96, kv_block=32, max_batch=4, check_every=4, eos_token_id=eos)
    out = engine.generate(prompts, 40, SamplingParams(temperature=0))
    assert completions(out) == hf_greedy(model, prompts, 40, eos=eos)


def test_continuous_scheduler_stop_strings_and_eos_under_cuda_graphs_fp32():
    """Stop strings and EOS with refills (24 sequences, width 16) and compaction to 8 rows, decoded from CUDA
    graphs: each completion is HF's greedy one cut right after its EOS or after the token completing the
    stop string, whichever comes first, with the matching finish reason."""
    from test_rollout_engine import CharTokenizer

    model = tiny_model("qwen2").cuda()
    tok = CharTokenizer()
    prompts = prompts_of(PROMPT_LENGTHS * 2, seed=9)
    free = hf_greedy(model, prompts, 40)
    stop = tok.decode(free[0][9:11])
    eos = free[1][5]
    engine = RolloutEngine(model, tokenizer=tok, max_seq_len=96, kv_block=32, max_batch=16, check_every=4,
                           eos_token_id=eos)
    assert engine.cuda_graphs
    out = engine.generate(prompts, 40, SamplingParams(temperature=0), stop=[stop])
    assert 8 in {b for b, _ in engine.graphs}, "no compaction into a narrower batch"
    cut = 0
    for row, full, reason in zip(completions(out), free, out.finish_reason):
        end = full.index(eos) + 1 if eos in full else len(full)
        text_end = next((k for k in range(1, end + 1) if stop in tok.decode(full[:k])), None)
        end = min(end, text_end or end)
        assert row == full[:end]
        assert reason == ("length" if end == len(full) and eos not in full[:end] else "stop")
        cut += end < len(full)
    assert cut >= 3, "too few rows stopped early to check the bookkeeping"


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_graphs_kept_across_an_update_equal_graphs_captured_again(fmt):
    """What `rollout.release_kv_cache: null` (auto) relies on: a rollout replaying the graphs kept from the
    previous one (refills, compaction to 8 rows, AQN), after the optimizer moved the adapter in place, samples
    exactly what a rollout on freshly captured graphs samples."""
    model = quantize_tiny(tiny_model("qwen3"), fmt=fmt).cuda().to(torch.bfloat16)
    prompts = [p for p in prompts_of([7, 2, 11, 5, 9, 4, 6, 3], seed=2) for _ in range(3)]
    lengths = [3, 40, 9, 17, 1, 33, 25, 6, 12, 40, 2, 20] * 2
    sp = SamplingParams(temperature=0.8)
    engine = RolloutEngine(model, max_seq_len=96, kv_block=32, max_batch=16, check_every=4)

    def rollout():
        return engine.generate(prompts, 40, sp, seed=3, force_lengths=lengths, aqn=NoisyNorms(model, 0.05, seed=1))

    before = rollout()
    graphs = dict(engine.graphs)
    with torch.no_grad():  # an optimizer step: in place, as AdamW updates the fp32 masters
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p), alpha=0.5)
    kept = rollout()
    assert dict(engine.graphs) == graphs, "the kept graphs were not the ones replayed"
    engine.release_memory()
    fresh = rollout()
    assert not torch.equal(kept.completion_ids, before.completion_ids)  # the update reached the kept graphs
    assert torch.equal(kept.completion_ids, fresh.completion_ids)
    torch.testing.assert_close(kept.logprobs, fresh.logprobs, atol=0, rtol=0)
    torch.testing.assert_close(kept.entropies, fresh.entropies, atol=0, rtol=0)
