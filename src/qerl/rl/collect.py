"""One step's experience: sample G completions per prompt (with AQN noise), score them, shape rewards,
keep the groups that carry signal (DAPO dynamic sampling) and compute group advantages."""

import time
from dataclasses import dataclass, field

import torch

from ..nn.noisy_norm import NoisyNorms
from ..rollout import Rollout, RolloutEngine, SamplingParams
from .advantages import group_advantages, mixed_groups, overlong_penalty


@dataclass(frozen=True)
class CollectSettings:
    """How one step's experience is sampled, scored and selected; fixed for a run.

    The per-step inputs, the AQN sigma and the sampler's generator, are arguments of `collect_experience`.
    """

    # sampling
    group_size: int = 8  # G: completions per prompt, compared with each other for the advantage
    prompts_per_step: int = 8  # prompts of this process per batch (the run's prompts_per_step / processes)
    max_new_tokens: int = 256  # completion budget, tokens; a completion that reaches it is "truncated"
    sampling: SamplingParams = SamplingParams()  # temperature, top-k, top-p
    aqn_per_forward: bool = False  # redraw the AQN noise before every forward instead of once per batch
    aqn_relative: bool = False  # noise std sigma * |w| per norm channel (aqn.relative)
    # advantages and DAPO's selection / reward shaping
    scale_rewards: bool = True  # divide each group's centred rewards by their std (GRPO; not Dr. GRPO)
    dynamic_sampling: bool = False  # keep only groups with mixed rewards, sample more prompts to refill
    max_refills: int = 0  # at most this many further batches of prompts per step for dynamic sampling
    overlong_filter: bool = False  # truncated completions get an all-False loss mask
    overlong_buffer: int = 0  # soft overlong punishment over the last this many tokens of the budget (0 = off)


@dataclass
class Experience:
    """Everything the update needs, rows = prompts x G (each prompt's G completions adjacent).

    prompt_ids/prompt_mask [N, P] left-padded; completion_ids [N, T]; completion_mask [N, T] bool (loss
    mask: overlong-filtered rows are all False); sampling_logp / entropies [N, T] fp32 from the sampler;
    rewards / advantages [N] fp32; lengths [N] int64 (tokens generated, before filtering).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sampling_logp: torch.Tensor
    entropies: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without a stop
    texts: list[str] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)


def collect_experience(engine: RolloutEngine, problems, encode_prompt, reward_runner, settings: CollectSettings, *,
                       sigma: float, generator: torch.Generator) -> Experience:
    """Sample, score and select one step's groups.

    problems: callable n -> list of rows ({"question", "answer", ...}); encode_prompt: row -> (prompt
    text, token ids); reward_runner: a `qerl.rewards.RewardRunner`. sigma: the AQN noise std for this
    step (0 = no noise); generator: draws the samples and the noise. Dynamic sampling draws further
    batches of `prompts_per_step` prompts (at most `max_refills` more) until that many groups with mixed
    rewards are found; with fewer, the step trains on what it has and reports it.
    """
    s = settings
    group_size, prompts_per_step = s.group_size, s.prompts_per_step
    kept, kept_rewards, kept_texts = [], [], []
    stats = {"groups_sampled": 0.0, "gen_tokens": 0.0, "gen_seconds": 0.0}
    reward_sums: dict[str, list[float]] = {"sampled": [0.0, 0.0]}
    need = prompts_per_step
    for _ in range(1 + (s.max_refills if s.dynamic_sampling else 0)):
        rows = problems(prompts_per_step)
        encoded = [encode_prompt(r) for r in rows]
        prompt_texts = [text for text, _ in encoded for _ in range(group_size)]
        prompt_ids = [ids for _, ids in encoded for _ in range(group_size)]
        aqn = (NoisyNorms(engine.model, sigma, per_forward=s.aqn_per_forward, generator=generator,
                          relative=s.aqn_relative) if sigma > 0 else None)
        start = time.perf_counter()
        rollout = engine.generate(prompt_ids, s.max_new_tokens, s.sampling, generator=generator, aqn=aqn)
        stats["gen_seconds"] += time.perf_counter() - start
        stats["gen_tokens"] += float(rollout.completion_mask.sum())
        for k in ("decoded_row_steps", "kept_tokens", "prefill_tokens"):  # the rollout's work (engine stats)
            stats[f"rollout_{k}"] = stats.get(f"rollout_{k}", 0.0) + float(rollout.stats.get(k, 0))
        columns = {k: [r.get(k) for r in rows for _ in range(group_size)] for k in rows[0] if k != "question"}
        rewards, per_func, reward_stats = reward_runner.score(prompt_texts, rollout.texts, columns)
        for k, v in reward_stats.items():
            stats[k] = stats.get(k, 0.0) + float(v)
        for name, values in [("sampled", rewards), *per_func.items()]:
            valid = [v for v in values if v is not None]
            acc = reward_sums.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + sum(valid), acc[1] + len(valid)
        r = torch.tensor(rewards, dtype=torch.float32, device=rollout.completion_ids.device)
        stats["groups_sampled"] += len(rows)
        if not s.dynamic_sampling:
            kept, kept_rewards, kept_texts = [rollout], [r], list(rollout.texts)
            break
        keep = mixed_groups(r, group_size)
        idx = keep.repeat_interleave(group_size).nonzero().squeeze(1)
        if idx.numel():
            kept.append(_select(rollout, idx))
            kept_rewards.append(r[idx])
            kept_texts += [rollout.texts[i] for i in idx.tolist()]
        need -= int(keep.sum())
        if need <= 0:
            break
    if not kept:
        broken = failed_rewards(stats, reward_runner.names, stats["groups_sampled"] * group_size)
        cause = (f"reward {broken[0]} failed on every row ({reward_runner.last_errors.get(broken[0])})" if broken
                 else "the task is too easy or too hard for the model (or raise algo.max_refills)")
        raise NoSignalError(f"dynamic sampling found no group with mixed rewards in {int(stats['groups_sampled'])} "
                            f"prompts: {cause}")
    both = Rollout.concat(kept, engine.pad_token_id)
    merged = {"prompt_ids": both.prompt_ids, "prompt_mask": both.prompt_mask, "completion_ids": both.completion_ids,
              "completion_mask": both.completion_mask, "sampling_logp": both.logprobs, "entropies": both.entropies}
    rewards = torch.cat(kept_rewards)
    truncated = torch.tensor([f == "length" for r in kept for f in r.finish_reason], device=rewards.device)
    n = min(rewards.numel(), prompts_per_step * group_size)  # the last refill may overshoot
    merged = {k: v[:n] for k, v in merged.items()}
    rewards, truncated, kept_texts = rewards[:n], truncated[:n], kept_texts[:n]
    lengths = merged["completion_mask"].sum(1)
    rewards = rewards + overlong_penalty(lengths, s.max_new_tokens, s.overlong_buffer).to(rewards.device)
    advantages = group_advantages(rewards, group_size, scale=s.scale_rewards)
    loss_mask = merged["completion_mask"] & ~(truncated & s.overlong_filter).unsqueeze(1)
    stats["groups_kept"] = float(n // group_size)
    for name, (total, count) in reward_sums.items():
        stats[f"reward/{name}"] = total / max(count, 1)
    return Experience(merged["prompt_ids"], merged["prompt_mask"], merged["completion_ids"], loss_mask,
                      merged["sampling_logp"], merged["entropies"], rewards, advantages, lengths, truncated,
                      kept_texts, stats)


def failed_rewards(stats: dict[str, float], names, rows: float) -> list[str]:
    """The reward functions (of `names`) that failed on every one of `rows` rows: raised, timed out or gave no
    valid number (`stats["reward_errors/<name>"]`, as `collect_experience` sums them, or their mean over ranks
    with `rows` the mean too: a mean equals the mean row count only when every rank failed on every row).
    A row a function declines (None) is not a failure."""
    return [name for name in names if rows > 0 and stats.get(f"reward_errors/{name}", 0.0) >= rows]


class NoSignalError(RuntimeError):
    """Dynamic sampling could not find any group with a learning signal."""


def _select(r: Rollout, idx: torch.Tensor) -> Rollout:
    return Rollout(r.prompt_ids[idx], r.prompt_mask[idx], r.completion_ids[idx], r.completion_mask[idx],
                   r.logprobs[idx], r.entropies[idx], [r.finish_reason[i] for i in idx.tolist()], None)
