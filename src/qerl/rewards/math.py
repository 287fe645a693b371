"""Answer correctness with math-verify: 1.0 when the completion's final answer equals the reference.

The completion's answer is the content of its last `####` / `\\boxed{}` / `<answer>` marker
(`extract.final_answer`); with no marker, math-verify reads the whole text (it takes the last number or
expression), unless `require_marker=True`. The reference may be a GSM8K solution ending in `#### N`
(N is taken), a text with a `\\boxed{}`, or a plain answer / LaTeX expression. math-verify normalises
commas in numbers, units, `$`, `\\text{}` and trailing `.0`, and compares numerically or symbolically.

Time bounds: math-verify bounds each parse/verify with `signal.alarm`, which exists only on a process's
main thread. We use it there (per-item bound, e.g. inside `RewardRunner`'s worker processes) and switch
it off elsewhere, where the caller bounds the whole call (`RewardRunner` does).
"""

import logging
import threading

from .extract import STYLES, completion_text, final_answer

# math-verify warns once per process that its timeout is off; off-main-thread that is intended (see above)
logging.getLogger("math_verify").setLevel(logging.ERROR)

ITEM_TIMEOUT_S = 5  # per parse / verify, when signal.alarm is usable
MAX_ANSWER_CHARS = 1000  # longer "answers" are degenerate text; parsing them only costs time


def _timeout() -> int | None:
    return ITEM_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(text: str) -> list:
    from math_verify import parse

    text = text[-MAX_ANSWER_CHARS:] if len(text) > MAX_ANSWER_CHARS else text
    return parse(text, parsing_timeout=_timeout())


def reference_answer(answer: str) -> str:
    """The answer part of a reference: text after the last `####`, the last boxed content, or all of it."""
    found = final_answer(answer, styles=("gsm8k", "boxed"))
    return found.text if found is not None else answer.strip()


def parse_reference(answer: str) -> list:
    """Parsed reference (math-verify objects); a raw string when nothing parses, so that an exotic
    reference still matches an identical predicted string instead of never matching."""
    ref = reference_answer(answer)
    return _parse(f"\\boxed{{{ref}}}") or _parse(ref) or [ref]


def parse_prediction(completion: str, require_marker: bool = False, styles=STYLES) -> list:
    """Parsed final answer of a completion, [] when there is none. styles: the marker styles that count (the
    last of them is the answer); require_marker=True: none of them -> [] (no last-number fallback)."""
    found = final_answer(completion, styles)
    if found is None:
        return [] if require_marker else _parse(completion)
    if found.style == "boxed":
        return _parse(f"\\boxed{{{found.text}}}")
    return _parse(found.text) or _parse(f"\\boxed{{{found.text}}}")


def is_correct(completion: str, answer: str, require_marker: bool = False) -> bool:
    """Whether the completion's final answer equals the reference answer (math-verify semantics)."""
    from math_verify import verify

    pred = parse_prediction(completion, require_marker)
    return bool(pred) and verify(parse_reference(answer), pred, timeout_seconds=_timeout())


class MathReward:
    """Answer correctness as a reward function with the TRL signature (a picklable object, so that
    `RewardRunner` can run it in a worker process). require_marker=True scores 0 a completion with no
    `####` / `\\boxed{}` / `<answer>` marker instead of reading its last number."""

    def __init__(self, require_marker: bool = False):
        self.require_marker = require_marker
        self.__name__ = "math_strict" if require_marker else "math"

    def __call__(self, prompts, completions, answer=None, **columns) -> list[float | None]:
        """1.0 correct, 0.0 wrong, None for rows with no reference (`answer` None or empty).

        prompts, completions: N strings (or chat message lists); answer: N reference strings.
        """
        if answer is None:
            raise KeyError("math reward needs an 'answer' column (the reference answer of each problem)")
        if len(answer) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
        out: list[float | None] = []
        for completion, ref in zip(completions, answer):
            if ref is None or not str(ref).strip():
                out.append(None)
                continue
            out.append(float(is_correct(completion_text(completion), str(ref), self.require_marker)))
        return out


math_reward = MathReward()
