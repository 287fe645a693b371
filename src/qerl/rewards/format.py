"""Format reward: 1.0 when the completion ENDS with a parseable final answer in the expected style.

Styles: "gsm8k" (`#### 42` on the last line), "boxed" (`\\boxed{42}`), "answer_tag" (`<answer>42</answer>`),
or "any" of them. "Ends with" allows only closing punctuation after the marker (`.`, `$`, `\\]`, `**`,
whitespace), so a model is not paid for an answer it keeps talking past. "Parseable" means math-verify
extracts something from the answer text (a number, an expression, LaTeX).
"""

import re

from .extract import STYLES, completion_text, final_answer
from .math import _parse

_TRAILER = re.compile(r"[\s.$*)\]\\]*")


def follows_format(completion: str, style: str = "any") -> bool:
    """Whether the text ends with a parseable final answer of `style` (see the module docstring)."""
    styles = STYLES if style == "any" else (style,)
    found = final_answer(completion, styles)
    if found is None or not _TRAILER.fullmatch(completion, found.end):
        return False
    return bool(_parse(found.text if found.style != "boxed" else f"\\boxed{{{found.text}}}"))


class FormatReward:
    """Reward function (TRL signature, picklable): 1.0 if `follows_format(completion, style)` else 0.0."""

    def __init__(self, style: str = "any"):
        if style not in STYLES + ("any",):
            raise ValueError(f"unknown answer style {style!r}; choose one of {STYLES + ('any',)}")
        self.style = style
        self.__name__ = "format" if style == "any" else f"format_{style}"

    def __call__(self, prompts, completions, **columns) -> list[float]:
        """prompts, completions: N strings (or chat message lists) -> N rewards in {0.0, 1.0}."""
        return [float(follows_format(completion_text(c), self.style)) for c in completions]


def make_format_reward(style: str = "any") -> FormatReward:
    """A format reward for one answer style: "gsm8k", "boxed", "answer_tag" or "any"."""
    return FormatReward(style)


format_reward = FormatReward()
