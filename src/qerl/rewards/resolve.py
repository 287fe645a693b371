"""Reward functions named in a config: a built-in name or a user function "package.module:function"."""

import importlib
import sys
from pathlib import Path

from . import get_reward


def _import_user_module(module: str):
    """Import `module` as `python -m qerl.cli` would: the current directory is searched too (the `qerl`
    script's sys.path starts at its own bin/ directory instead). It is appended, not prepended, so a local
    file never shadows an installed package; the reward worker processes inherit this sys.path."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = str(Path.cwd())
        if e.name != module.partition(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module)


def resolve_reward(name: str):
    """A built-in reward by name ("math", "format", ...; `qerl.rewards.REWARDS`) or a user function
    "package.module:function" with the TRL signature f(prompts, completions, **columns) -> list[float | None];
    the module is looked up on sys.path, then in the current directory."""
    if ":" not in name:
        try:
            return get_reward(name)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
    module, _, attr = name.partition(":")
    try:
        func = getattr(_import_user_module(module), attr)
    except (ImportError, AttributeError) as e:
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module.partition(".")[0]:
            hint = (f"; looked in the current directory ({Path.cwd()}) and on sys.path: put the module's folder "
                    "on PYTHONPATH")
        raise ValueError(f"reward {name!r}: cannot import ({e}){hint}") from None
    if not callable(func):
        raise ValueError(f"reward {name!r} is not callable")
    return func
