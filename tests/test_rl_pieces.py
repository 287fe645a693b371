"""Pieces of the RL loop on real (tiny) components: dynamic sampling, the entropy controller, the prompt
stream, non-finite steps, out-of-memory and config errors."""

from pathlib import Path

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from qerl.config import ConfigError, load_config
from qerl.models import quantize_model
from qerl.nn import LoraConfig
from qerl.rewards import RewardRunner
from qerl.rl.aqn import EntropyController
from qerl.rl.collect import CollectSettings, NoSignalError, collect_experience
from qerl.rl.prompt_stream import PromptStream
from qerl.rollout.engine import RolloutEngine
from qerl.rollout.sampling import SamplingParams


def kind_reward(prompts, completions, kind, **columns):
    """easy: always 1, hard: always 0, mixed: 1 and 0 alternating along the batch (a group's G completions
    are adjacent, so a mixed group always has both)."""
    return [1.0 if k == "easy" else 0.0 if k == "hard" else float(i % 2) for i, k in enumerate(kind)]


@pytest.fixture(scope="module")
def engine():
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4", LoraConfig(r=4, alpha=8))
    return RolloutEngine(model, tiny_tokenizer(), max_seq_len=64)


def _encode(row):
    tok = tiny_tokenizer()
    return row["question"], tok(row["question"]).input_ids


def broken_reward(prompts, completions, **columns):
    raise KeyError("solution")


def _collect(engine, rows, reward=kind_reward, **kw):
    stream = PromptStream(rows, seed=0)
    runner = RewardRunner([reward], timeout_s=30, isolation="inline")
    gen = torch.Generator().manual_seed(0)
    settings = CollectSettings(**{"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 12,
                                  "sampling": SamplingParams(1.0), **kw})
    return collect_experience(engine, stream.take, _encode, runner, settings, sigma=0.0, generator=gen), stream


def test_dynamic_sampling_keeps_only_mixed_groups_and_refills(engine):
    # one mixed problem in eight: a draw of two prompts holds at most one, so refills are always needed
    kinds = ["easy", "hard", "mixed", "easy", "hard", "hard", "hard", "easy"]
    rows = [{"question": f"q{i} {k}", "answer": "1", "kind": k} for i, k in enumerate(kinds)]
    exp, _ = _collect(engine, rows, dynamic_sampling=True, max_refills=12)
    assert exp.stats["groups_kept"] == 2
    assert exp.stats["groups_sampled"] > 2  # it had to sample more prompts to refill the batch
    groups = exp.rewards.view(-1, 4)
    assert ((groups != groups[:, :1]).any(dim=1)).all()  # every kept group has a learning signal
    assert exp.advantages.abs().sum() > 0
    assert len(exp.texts) == 8 and exp.completion_ids.shape[0] == 8


def test_dynamic_sampling_without_any_signal_says_so(engine):
    rows = [{"question": f"q{i}", "answer": "1", "kind": "easy"} for i in range(4)]
    with pytest.raises(NoSignalError, match="no group with mixed rewards in 6 prompts: the task is too easy"):
        _collect(engine, rows, dynamic_sampling=True, max_refills=2)


def test_dynamic_sampling_blames_a_reward_that_failed_on_every_row_not_the_task(engine):
    rows = [{"question": f"q{i}", "answer": "1", "kind": "mixed"} for i in range(4)]
    with pytest.raises(NoSignalError, match=r"reward broken_reward failed on every row \(raised KeyError: 'solution"):
        _collect(engine, rows, reward=broken_reward, dynamic_sampling=True, max_refills=1)


def test_without_dynamic_sampling_flat_groups_get_zero_advantage(engine):
    rows = [{"question": f"q{i}", "answer": "1", "kind": "easy"} for i in range(4)]
    exp, _ = _collect(engine, rows)
    assert exp.stats["groups_kept"] == 2 and torch.equal(exp.advantages, torch.zeros(8))


def test_overlong_filter_masks_truncated_completions(engine):
    rows = [{"question": f"q{i} mixed", "answer": "1", "kind": "mixed"} for i in range(4)]
    exp, _ = _collect(engine, rows, max_new_tokens=3, overlong_filter=True)
    assert exp.truncated.any()
    assert not exp.completion_mask[exp.truncated].any()


def test_entropy_controller():
    c = EntropyController(target=1.0, gain=0.5)
    assert c.update(0.5) > 1.0  # too little entropy: more noise
    m = c.multiplier
    assert c.update(2.0) < m  # too much: less
    for _ in range(100):
        c.update(0.0)
    assert c.multiplier == 10.0  # bounded
    assert c.update(float("nan")) == 10.0  # a NaN entropy changes nothing
    with pytest.raises(ValueError):
        EntropyController(target=0.0)


def test_prompt_stream_reshuffles_and_resumes():
    rows = [{"question": str(i)} for i in range(5)]
    a = PromptStream(rows, seed=3)
    first = [r["question"] for r in a.take(7)]
    assert sorted(first[:5]) == [str(i) for i in range(5)]  # one full epoch before any repeat
    state = a.state()
    rest = [r["question"] for r in a.take(6)]
    b = PromptStream(rows, seed=3)
    b.load_state(state)
    assert [r["question"] for r in b.take(6)] == rest
    with pytest.raises(ValueError, match="5 problems"):
        PromptStream(rows[:4], seed=3).load_state(state)
    with pytest.raises(ValueError, match="empty"):
        PromptStream([], seed=0)


@pytest.mark.parametrize("override, message", [
    ("rollout.group_size=1", "group_size must be >= 2"),
    ("algo.name=ppo", "algo.name"),
    ("optim.lr=0", "optim.lr must be > 0"),
    ("aqn.decay=quadratic", "aqn.decay"),
    ("lora.dropout=1.5", "lora: LoRA dropout"),
    ("lora.r=0", "lora: LoRA rank"),
    ("rollout.top_p=0", "top_p"),
    ("steps=2.5", "steps: expected an integer"),
    ("model.format=int8", "model.format"),
    ("rewards=[]", "at least one reward"),
    ("reward_weights=[1, 2]", "reward_weights has 2 entries"),
    ("algo.overlong_buffer=999", "overlong_buffer"),
    ("nonsense=1", "unknown key"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    bad.write_text("rollout: 3")
    with pytest.raises(ConfigError, match="rollout: expected a mapping"):
        load_config(bad)


def test_the_loop_settings_come_from_the_config():
    from qerl.rl.settings import collect_settings, update_settings

    recipe = Path(__file__).parent.parent / "configs" / "bigmath-dapo-7b.yaml"
    cfg = load_config(recipe, ["rollout.temperature=0", "algo.num_updates=2"])
    collect = collect_settings(cfg, world=4)
    assert collect.prompts_per_step == 32 and collect.group_size == 8 and collect.sampling.greedy
    assert collect.dynamic_sampling and collect.max_refills == 4 and collect.overlong_buffer == 512
    update = update_settings(cfg)
    assert update.loss.algo == "dapo" and update.loss.clip_high == 0.28 and update.loss.max_new_tokens == 4096
    assert update.num_updates == 2 and update.micro_batch_size == 8 and update.temperature == 0.0
    assert not collect_settings(load_config(None, ["algo.name=dr_grpo"])).scale_rewards  # Dr. GRPO: no std
    # the config's lora section is the LoraConfig the model surgery takes, with YAML's list of targets
    assert isinstance(cfg.lora, LoraConfig) and cfg.lora.scaling == 2.0 and isinstance(cfg.lora.targets, list)


def test_greedy_log_probs_are_taken_at_temperature_one():
    from qerl.rl.logprobs import completion_logprobs, logprob_temperature

    assert logprob_temperature(0.0) == 1.0 and logprob_temperature(0.7) == 0.7
    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8))
    ids = torch.randint(3, 150, (2, 5), generator=torch.Generator().manual_seed(0))
    ones = torch.ones(2, 5, dtype=torch.bool)
    with torch.no_grad():
        greedy, unit = (completion_logprobs(model, ids, ones, ids, ones, t) for t in (0.0, 1.0))
    assert torch.equal(greedy, unit)
