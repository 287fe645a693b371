"""Find the final answer a completion commits to: the LAST `####`, `\\boxed{}` or `<answer>` marker.

After `####` the answer is the number right after the marker, as in GSM8K's reference solutions and
lm-evaluation-harness's strict match ("#### 18 (3 bags of 6)" answers 18); only when no number follows the
marker (`#### \\frac{1}{2}`, "#### The answer is 18") is the rest of its line the answer text.

Models often restate intermediate results in the same style ("... \\boxed{5} ... so \\boxed{7}"), and
math-verify on the whole text would read two boxes as the set {5, 7}; cutting out the last marker's
content first makes "the last answer counts" hold for every style.
"""

import re
from dataclasses import dataclass

STYLES = ("gsm8k", "boxed", "answer_tag")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####[ \t]*((?:(?!####)[^\n])*)")  # to the line's end or the next marker
# a number opening the text after `####`: a sign, digits with thousands commas, decimals or a fraction; currency,
# markdown bold and inline-math openers may come first ("$1,250.50", "**18**", "\\(42\\)")
_LEADING_NUMBER = re.compile(r"(?:\$|\*\*|\\\(|\s)*(-?\d[\d,]*(?:\.\d+)?(?:/\d+)?)(?![\d.]*[a-zA-Z\\^_{])")


@dataclass(frozen=True)
class FinalAnswer:
    """One answer marker in a text: style in STYLES, the answer text inside it, and its [start, end) span."""

    style: str
    text: str
    start: int
    end: int


def _last_boxed(text: str) -> FinalAnswer | None:
    """The last `\\boxed{...}` with balanced braces (an unclosed box at the end is no answer)."""
    for m in reversed(list(_BOXED.finditer(text))):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return FinalAnswer("boxed", text[m.end():i - 1].strip(), m.start(), i)
    return None


def _last(pattern: re.Pattern, text: str, style: str) -> FinalAnswer | None:
    last = None
    for last in pattern.finditer(text):
        pass
    return None if last is None else FinalAnswer(style, last.group(1).strip(), last.start(), last.end())


def final_answer(text: str, styles=STYLES) -> FinalAnswer | None:
    """The marker (among `styles`) that starts last in `text`, or None when there is none."""
    found = []
    if "answer_tag" in styles:
        found.append(_last(_ANSWER_TAG, text, "answer_tag"))
    if "boxed" in styles:
        found.append(_last_boxed(text))
    if "gsm8k" in styles:
        hashes = _last(_HASHES, text, "gsm8k")
        number = _LEADING_NUMBER.match(hashes.text) if hashes is not None else None
        if number:  # the span stays the marker's line: what follows the number is still part of the answer line
            hashes = FinalAnswer("gsm8k", number.group(1).rstrip(","), hashes.start, hashes.end)
        found.append(hashes)
    found = [f for f in found if f is not None and f.text]
    return max(found, key=lambda f: f.start) if found else None


def completion_text(completion) -> str:
    """A completion as text: a string, or (TRL conversational format) a list of messages -> last content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"completion must be a str or a list of chat messages, got {type(completion).__name__}")
