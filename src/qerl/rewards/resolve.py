"""Reward functions named in a config: a built-in name or a user function "package.module:function"."""

import importlib

from . import get_reward


def resolve_reward(name: str):
    """A built-in reward by name ("math", "format", ...; `qerl.rewards.REWARDS`) or a user function
    "package.module:function" with the TRL signature f(prompts, completions, **columns) -> list[float | None]."""
    if ":" not in name:
        try:
            return get_reward(name)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
    module, _, attr = name.partition(":")
    try:
        func = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {name!r}: cannot import ({e})") from None
    if not callable(func):
        raise ValueError(f"reward {name!r} is not callable")
    return func
