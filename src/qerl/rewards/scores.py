"""The four per-completion measures of an evaluation on math problems, for the answer format the prompt asked for.

flexible        the math reward (`math.math_reward`): the last `####` / `\\boxed{}` / `<answer>` marker's answer of
                any style, else math-verify's reading of the whole text (its last number), equals the reference.
strict          the answer in the LAST marker of the requested style equals the reference; no such marker -> wrong.
                "Some other style's marker" or "the right number in prose" does not count. With no requested style
                (suffix none or a free "text:" suffix), any style's marker counts (`MathReward(require_marker=True)`).
extractable     the flexible reading found an answer at all (a marker with content, or a number / expression
                math-verify reads in the text): False mostly for completions cut off before any number.
follows_format  `format.follows_format(text, style)`: the text ENDS with a parseable answer in the requested style
                (style "any" when none was requested).

These correspond to lm-evaluation-harness's two GSM8K filters: strict-match (the number after "#### ") and
flexible-extract (the last number in the text); ours also reads `\\boxed{}` / `<answer>` and compares answers with
math-verify instead of string equality.
"""

from dataclasses import dataclass

from .extract import STYLES, completion_text
from .format import follows_format
from .math import _timeout, parse_prediction, parse_reference


@dataclass(frozen=True)
class Score:
    """One completion's measures; flexible / strict are None when the row has no reference answer."""

    flexible: bool | None
    strict: bool | None
    extractable: bool
    follows_format: bool


def score(completion, answer: str | None, style: str | None = None) -> Score:
    """The four measures of one completion (a string or chat message list) against its reference `answer`, for
    the requested answer `style` ("gsm8k", "boxed", "answer_tag", or None: no style requested)."""
    from math_verify import verify

    if style is not None and style not in STYLES:
        raise ValueError(f"unknown answer style {style!r}; choose one of {STYLES} or None")
    text = completion_text(completion)
    flexible_pred = parse_prediction(text)
    strict_pred = parse_prediction(text, require_marker=True, styles=STYLES if style is None else (style,))
    fmt = follows_format(text, style or "any")
    if answer is None or not str(answer).strip():
        return Score(None, None, bool(flexible_pred), fmt)
    ref = parse_reference(str(answer))

    def correct(pred: list) -> bool:
        return bool(pred) and bool(verify(ref, pred, timeout_seconds=_timeout()))

    return Score(correct(flexible_pred), correct(strict_pred), bool(flexible_pred), fmt)


def score_all(completions: list, answers: list, style: str | None = None) -> list[Score]:
    """`score` of each (completion, answer) pair."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    return [score(c, a, style) for c, a in zip(completions, answers)]
