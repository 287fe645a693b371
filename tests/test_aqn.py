"""AQN: the noise schedule, the noisy-norm context (exact restore, clean state_dict) and its effect on the
rollout engine's sampled policy (sigma = 0 bit-identical, sigma > 0 different)."""

import math

import pytest
import torch

from qerl.nn.noisy_norm import NoisyNorms, find_noisy_norms
from qerl.rl.aqn import DECAYS, AQNSchedule, stage_sigma
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import SamplingParams

from test_rollout_engine import prompts_of, quantize_tiny, tiny_model


# ------------------------------------------------------------------------------------------ schedule


def test_exponential_schedule_matches_design_formula():
    K, s0, s1 = 10, 1e-2, 5e-4
    sig = [stage_sigma(k, K, s0, s1) for k in range(K)]
    assert sig[0] == 0.0
    assert sig[1] == pytest.approx(s0, rel=1e-12) and sig[-1] == pytest.approx(s1, rel=1e-12)
    for k in range(1, K):
        assert sig[k] == pytest.approx(s0 * (s1 / s0) ** ((k - 1) / (K - 2)), rel=1e-12)
    ratios = [sig[k + 1] / sig[k] for k in range(1, K - 1)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)  # geometric


@pytest.mark.parametrize("decay", DECAYS)
def test_every_decay_starts_ends_and_decreases(decay):
    sig = [stage_sigma(k, 8, 1e-2, 1e-4, decay) for k in range(8)]
    assert sig[0] == 0.0
    assert sig[1] == pytest.approx(1e-2) and sig[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(sig[1:], sig[2:]))


def test_decays_differ_in_the_middle():
    mid = {d: stage_sigma(5, 10, 1e-2, 5e-4, d) for d in DECAYS}
    assert mid["linear"] == pytest.approx(1e-2 + (5e-4 - 1e-2) * 4 / 8)
    assert mid["cosine"] == pytest.approx(5e-4 + (1e-2 - 5e-4) * (1 + math.cos(math.pi / 2)) / 2)
    assert mid["logarithmic"] < mid["linear"]  # fast early decay
    assert mid["exponential"] < mid["linear"]
    assert len(set(mid.values())) == 4


def test_schedule_over_steps():
    s = AQNSchedule(num_stages=4, sigma_start=1e-2, sigma_end=1e-3)
    stages = [s.stage(i, 100) for i in range(100)]
    assert stages[0] == 0 and stages[24] == 0 and stages[25] == 1 and stages[99] == 3
    assert s.sigma(0, 100) == 0.0 and s.sigma(99, 100) == pytest.approx(1e-3)
    assert AQNSchedule(enabled=False).sigma(50, 100) == 0.0
    assert stage_sigma(1, 2, 1e-2, 1e-3) == pytest.approx(1e-3)  # one noisy stage = the last one
    with pytest.raises(ValueError):
        AQNSchedule(decay="bogus")
    with pytest.raises(ValueError):
        s.sigma(100, 100)


# --------------------------------------------------------------------------------------- noisy norms


def norm_weights(model):
    return [n.weight.detach().clone() for n in find_noisy_norms(model)]


def test_finds_both_norms_of_every_layer():
    model = tiny_model("qwen2")
    norms = find_noisy_norms(model)
    assert len(norms) == 2 * model.config.num_hidden_layers
    assert model.model.norm not in norms  # final norm feeds lm_head, which gets no noise
    assert all(n is not l.self_attn.q_norm for l in model.model.layers for n in norms
               if hasattr(l.self_attn, "q_norm"))


def test_noise_is_applied_then_restored_bit_exactly_and_never_in_state_dict():
    model = tiny_model("llama")
    with torch.no_grad():  # non-trivial weights, so "restored" cannot pass by re-initialising to ones
        for n in find_noisy_norms(model):
            n.weight.uniform_(0.5, 1.5)
    clean = norm_weights(model)
    clean_sd = {k: v.clone() for k, v in model.state_dict().items()}
    sigma = 0.05
    with NoisyNorms(model, sigma, seed=0) as aqn:
        noisy = norm_weights(model)
        z = torch.cat([a - b for a, b in zip(noisy, clean)])
        assert z.abs().min() > 0
        assert z.std().item() == pytest.approx(sigma, rel=0.25)  # 4 x 64 channel draws
        assert not torch.equal(noisy[0] - clean[0], noisy[1] - clean[1])  # one vector per norm
        sd = model.state_dict()
        for k, v in clean_sd.items():
            assert torch.equal(sd[k], v), k  # the noise never reaches a checkpoint
        aqn.resample()
        assert not torch.equal(norm_weights(model)[0], noisy[0])
    for a, b in zip(norm_weights(model), clean):
        assert torch.equal(a, b)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in clean_sd.items())


def test_restored_even_when_the_body_raises():
    model = tiny_model("qwen3")
    clean = norm_weights(model)
    with pytest.raises(RuntimeError, match="boom"):
        with NoisyNorms(model, 0.1, seed=0):
            raise RuntimeError("boom")
    assert all(torch.equal(a, b) for a, b in zip(norm_weights(model), clean))


def test_bf16_weights_restored_exactly():
    model = tiny_model("qwen2").to(torch.bfloat16)
    clean = norm_weights(model)
    with NoisyNorms(model, 1e-3, seed=0):
        assert any(not torch.equal(a, b) for a, b in zip(norm_weights(model), clean))
    assert all(torch.equal(a, b) for a, b in zip(norm_weights(model), clean))


# ------------------------------------------------------------------------------------- in the engine


def test_sigma_zero_is_bit_identical_and_sigma_positive_changes_the_policy():
    model = quantize_tiny(tiny_model("qwen3"))
    engine = RolloutEngine(model, max_seq_len=64)
    prompts = prompts_of([5, 9, 7, 3], seed=2)
    sp = SamplingParams(temperature=1.0)
    base = engine.generate(prompts, 16, sp, seed=0, ignore_eos=True)
    zero = engine.generate(prompts, 16, sp, seed=0, ignore_eos=True, aqn=NoisyNorms(model, 0.0, seed=1))
    assert torch.equal(base.completion_ids, zero.completion_ids)
    assert torch.equal(base.logprobs, zero.logprobs) and torch.equal(base.entropies, zero.entropies)
    noisy = engine.generate(prompts, 16, sp, seed=0, ignore_eos=True, aqn=NoisyNorms(model, 0.05, seed=1))
    assert not torch.equal(base.logprobs, noisy.logprobs)
    # and the forward logits themselves (direct, no sampling involved)
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():
        ref = model(ids).logits
        with NoisyNorms(model, 0.0, seed=3):
            assert torch.equal(model(ids).logits, ref)
        with NoisyNorms(model, 0.05, seed=3):
            assert not torch.allclose(model(ids).logits, ref, atol=1e-4)
        assert torch.equal(model(ids).logits, ref)  # restored


def test_recorded_logprobs_are_those_of_the_noisy_policy():
    """With one noise draw per batch, the engine's log-probs equal a full forward under the same noise."""
    from test_rollout_engine import full_forward_logprobs

    model = tiny_model("llama")
    engine = RolloutEngine(model, max_seq_len=64)
    aqn = NoisyNorms(model, 0.1, seed=4)
    with aqn:
        out = engine.generate(prompts_of([6, 3], seed=8), 12, SamplingParams(temperature=1.0), seed=0,
                              ignore_eos=True, aqn=aqn)
        noisy_lp, _ = full_forward_logprobs(model, out, 1.0)
    clean_lp, _ = full_forward_logprobs(model, out, 1.0)
    torch.testing.assert_close(out.logprobs, noisy_lp, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(out.logprobs, clean_lp, atol=1e-3)


def test_per_forward_noise_redraws_every_step():
    model = tiny_model("qwen2")
    engine = RolloutEngine(model, max_seq_len=64)
    aqn = NoisyNorms(model, 0.05, per_forward=True, seed=0)
    seen = []
    orig = aqn.resample

    def spy():
        orig()
        seen.append(find_noisy_norms(model)[0].weight.detach().clone())

    aqn.resample = spy
    engine.generate(prompts_of([4]), 6, SamplingParams(temperature=0), ignore_eos=True, aqn=aqn)
    # one fresh draw per forward: the entry draw serves the prefill, then 5 decode steps (a refill's prefill,
    # later in a call, redraws too)
    assert len(seen) == 6
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:]))
    assert not aqn.active


# ------------------------------------------------------------------------------------------- its cost


def deeper(model, copies: int):
    """The same model with its decoder layers repeated `copies` times (more norms, same shapes)."""
    import copy

    layers = list(model.model.layers)
    for _ in range(copies - 1):
        model.model.layers.extend(copy.deepcopy(layer) for layer in layers)
    model.config.num_hidden_layers = len(model.model.layers)
    return model


def ops_issued(fn) -> list[str]:
    """The aten ops other than views that `fn` issues (top level: what a device would launch), in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:  # views launch nothing
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return c.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_costs_a_fixed_number_of_ops_whatever_the_depth(dtype):
    """Entering, redrawing and leaving issue the same few ops for 2 or 8 layers (the per-norm loop issued
    about 6 per norm per draw), and none of them reads a value back to the host."""
    counts = []
    for copies in (1, 4):
        model = deeper(tiny_model("llama"), copies).to(dtype)
        assert len(find_noisy_norms(model)) == 4 * copies
        aqn = NoisyNorms(model, 0.05, seed=0)
        enter, redraw = ops_issued(aqn.__enter__), ops_issued(aqn.resample)
        leave = ops_issued(lambda: aqn.__exit__(None, None, None))
        counts.append((len(enter), len(redraw), len(leave)))
        assert not any("item" in op or "_local_scalar_dense" in op for op in enter + redraw + leave)
    assert counts[0] == counts[1], counts
    assert counts[0][1] <= 6 and counts[0][2] == 1, counts


def test_one_flat_draw_gives_each_norm_its_own_slice():
    model = tiny_model("qwen2")
    clean = norm_weights(model)
    sigma = 0.05
    with NoisyNorms(model, sigma, seed=11):
        z = torch.cat([(a - b).reshape(-1) for a, b in zip(norm_weights(model), clean)]) / sigma
    expect = torch.randn(z.numel(), generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(z, expect, rtol=0, atol=1e-5)


def test_noise_writes_in_place_and_the_engine_keeps_its_graphs():
    """What the decode graphs and caches key on survives AQN: the norm weights keep their objects and
    addresses, the adapter signature is unchanged, and with graphs on (counted by a stand-in for the CUDA
    graph store, which replays eagerly) calls with AQN capture nothing new and reset nothing."""
    model = quantize_tiny(tiny_model("llama"))
    engine = RolloutEngine(model, max_seq_len=64)

    class CountingGraphs:
        def __init__(self):
            self.graphs, self.captures, self.resets = {}, 0, 0

        def replay(self, key, step):
            if key not in self.graphs:
                self.captures += 1
                self.graphs[key] = object()
            step()

        def reset(self):
            self.resets += 1
            self.graphs = {}

    engine.cuda_graphs, engine.decode_graphs = True, CountingGraphs()
    prompts, sp = prompts_of([5, 9, 7], seed=3), SamplingParams(temperature=1.0)
    norms = find_noisy_norms(model)
    ids = [(id(n.weight), n.weight.data_ptr()) for n in norms]
    engine.generate(prompts, 12, sp, seed=0, ignore_eos=True)
    captured, resets, sig = engine.decode_graphs.captures, engine.decode_graphs.resets, engine._graph_sig
    assert captured >= 1 and len(engine.graphs) == captured
    for per_forward in (False, True, False):
        engine.generate(prompts, 12, sp, seed=1, ignore_eos=True,
                        aqn=NoisyNorms(model, 0.05, per_forward=per_forward, seed=2))
        assert engine.decode_graphs.captures == captured and engine.decode_graphs.resets == resets
        assert len(engine.graphs) == captured and engine._graph_sig == sig
        assert [(id(n.weight), n.weight.data_ptr()) for n in norms] == ids


@pytest.mark.slow
def test_aqn_raises_sampling_entropy_on_the_real_model():
    """SmolLM2-135M-Instruct: noisy norms (one draw per batch) give a higher mean token entropy."""
    pretrained = pytest.importorskip("qerl.models.pretrained")
    model, tok = pretrained.load_causal_lm("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    engine = RolloutEngine(model, tokenizer=tok, max_seq_len=256)
    msgs = ["What is 12 + 35?", "Name a primary colour.", "Write one sentence about the sea.",
            "What is the capital of France?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True) for m in msgs]
    prompts = [p if isinstance(p[0], int) else p["input_ids"] for p in prompts]
    sp = SamplingParams(temperature=0.7)

    def mean_entropy(sigma, seed):
        out = engine.generate(prompts * 2, 32, sp, seed=seed, ignore_eos=True,
                              aqn=NoisyNorms(model, sigma, seed=seed) if sigma else None)
        return out.entropies[out.completion_mask].mean().item()

    clean = sum(mean_entropy(0.0, s) for s in range(2)) / 2
    noisy = sum(mean_entropy(0.05, s) for s in range(2)) / 2
    assert noisy > clean * 1.05, (clean, noisy)


def test_relative_noise_scales_each_channel_by_its_weight():
    """relative=True: w_j <- w_j (1 + sigma n_j) with the same draw n that the absolute noise would add as
    sigma n_j, and a channel with weight 0 stays 0."""
    model = tiny_model("qwen2")
    norms = find_noisy_norms(model)
    with torch.no_grad():
        norms[0].weight[:3] = 0.0
        norms[1].weight.mul_(7.0)
    clean = norm_weights(model)
    sigma = 0.05
    with NoisyNorms(model, sigma, seed=11, relative=True):
        noisy = norm_weights(model)
    n = torch.randn(sum(w.numel() for w in clean), generator=torch.Generator().manual_seed(11))
    expect = torch.cat([w.reshape(-1) for w in clean]) * (1 + sigma * n)
    torch.testing.assert_close(torch.cat([w.reshape(-1) for w in noisy]), expect, rtol=1e-6, atol=1e-7)
    assert torch.equal(noisy[0][:3], torch.zeros(3))
    assert all(torch.equal(a, b) for a, b in zip(norm_weights(model), clean))  # restored exactly


def test_the_config_switch_reaches_the_rollouts_noise():
    from qerl.config import load_config
    from qerl.rl.settings import collect_settings

    assert collect_settings(load_config(None, ["aqn.relative=true"])).aqn_relative is True
    assert collect_settings(load_config(None, [])).aqn_relative is False


# ------------------------------------------------------------------------------- noise against the weights


def test_median_norm_weight_and_the_weak_noise_note():
    from qerl.nn.noisy_norm import median_abs_norm_weight
    from qerl.rl.aqn import weak_noise_note

    model = tiny_model("qwen2")
    with torch.no_grad():
        for i, norm in enumerate(find_noisy_norms(model)):
            norm.weight.copy_(torch.linspace(-3.2, 3.2, norm.weight.numel()) * (1 if i % 2 else -1))
    weights = torch.cat([n.weight.detach().abs() for n in find_noisy_norms(model)])
    assert median_abs_norm_weight(model) == pytest.approx(float(weights.median()))
    # the 1.5B case (sigma 1e-2 at median 1.60) is flagged; SmolLM2's (1e-2 at 0.27) and 0.1 at 1.60 are not
    note = weak_noise_note(1e-2, 1.60)
    assert note and "0.6%" in note and "0.048" in note
    assert weak_noise_note(1e-2, 0.27) is None and weak_noise_note(0.1, 1.60) is None
    assert weak_noise_note(1e-2, 0.0) is None


@pytest.mark.parametrize("sigma,warned", [(1e-3, True), (0.1, False)])
def test_the_trainer_says_when_aqn_is_too_weak_for_the_model(tiny_dir, tmp_path, sigma, warned):
    import io
    import json

    from rich.console import Console

    from qerl.config import load_config
    from qerl.rl.trainer import Trainer

    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}=?", "answer": str(2 * a)}) + "\n" for a in range(1, 9)))
    cfg = load_config(None, [f"model.name={tiny_dir}", f"data.train={data}", "data.max_prompt_tokens=32",
                             "data.suffix=none", f"aqn.sigma_start={sigma}", "aqn.sigma_end=1e-4", "steps=1",
                             f"output_dir={tmp_path / 'run'}", "tensorboard=false", "plots=false"])
    out = io.StringIO()
    Trainer(cfg, console=Console(file=out, width=400))
    assert ("too little to change its sampling" in out.getvalue()) == warned
