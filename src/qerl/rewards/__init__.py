"""Reward functions with the TRL signature `f(prompts, completions, **columns) -> list[float | None]`
and the runner that calls them safely (bounded in time, failures counted)."""

from .format import FormatReward, follows_format, format_reward, make_format_reward
from .math import MathReward, is_correct, math_reward, reference_answer
from .runner import RewardRunner

REWARDS = {"math": math_reward, "math_strict": MathReward(require_marker=True), "format": format_reward,
           "format_gsm8k": make_format_reward("gsm8k"), "format_boxed": make_format_reward("boxed"),
           "format_answer_tag": make_format_reward("answer_tag")}


def get_reward(name: str):
    """A built-in reward function by name: math, math_strict, format, format_gsm8k, format_boxed,
    format_answer_tag."""
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; built-in rewards: {', '.join(REWARDS)}")
    return REWARDS[name]


__all__ = ["FormatReward", "MathReward", "REWARDS", "RewardRunner", "follows_format", "format_reward", "get_reward",
           "is_correct", "make_format_reward", "math_reward", "reference_answer"]
