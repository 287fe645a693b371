"""Per-completion evaluation measures (qerl.rewards.scores): flexible / strict correctness, extractable answer,
requested format followed, on a table of realistic completions. Expected values are written by hand."""

import pytest

from qerl.data.templates import BOXED_SUFFIX, GSM8K_SUFFIX, requested_style
from qerl.rewards import math_reward
from qerl.rewards.scores import Score, score, score_all

REFERENCE = "Janet sells 16 - 3 - 4 = 9 eggs at $2 each: 9 * 2 = 18.\n#### 18"

# (requested style, completion, (flexible, strict, extractable, follows_format))
TABLE = [
    ("gsm8k", "Janet has 16 - 3 - 4 = 9 eggs. 9 * 2 = 18.\n#### 18", (1, 1, 1, 1)),
    ("gsm8k", "So she makes 9 * 2 = 18 dollars. The answer is 18.", (1, 0, 1, 0)),  # right number, no marker
    ("gsm8k", "She makes 9 * 2 = 18 dollars.\n\\boxed{18}", (1, 0, 1, 0)),  # another style's marker
    ("gsm8k", "9 * 2 = 18\n#### 18 dollars", (1, 1, 1, 1)),  # the number right after ####; a unit may follow
    ("gsm8k", "Janet's ducks lay sixteen eggs per day. First, let me work out how many she", (0, 0, 0, 0)),  # cut off
    ("gsm8k", "#### 17\nActually it's 18", (0, 0, 1, 0)),  # the last marker counts, not a later bare number
    ("gsm8k", "#### 18\nWait, 9 * 2 = 18, so that checks out.", (1, 1, 1, 0)),  # talks past its marker
    ("gsm8k", "Janet has 16 - 3 - 4 = 9 eggs left, and she sells them for", (0, 0, 1, 0)),  # cut off: last number 9
    ("gsm8k", "\\boxed{17} Hmm, no: 9 * 2 = 18.\n#### 18", (1, 1, 1, 1)),
    ("gsm8k", "#### 18\nSo the answer is \\boxed{17}", (0, 1, 1, 0)),  # strict reads the last ####, flexible the box
    ("gsm8k", "#### $18.00", (1, 1, 1, 1)),
    ("gsm8k", "#### eighteen", (0, 0, 1, 0)),  # a marker with content is an answer, a wrong one
    ("gsm8k", "<answer>18</answer>", (1, 0, 1, 0)),
    ("gsm8k", "", (0, 0, 0, 0)),
    ("boxed", "So she makes $\\boxed{18}$.", (1, 1, 1, 1)),
    ("boxed", "#### 18", (1, 0, 1, 0)),
    # the format score says nothing of right
    ("boxed", "First guess \\boxed{18}, but recounting gives \\boxed{17}", (0, 0, 1, 1)),
    # an unclosed box is no marker, and math-verify reads no answer from the text around it (behaviour of
    # math_reward as it stands: a completion cut off inside its box scores as having no answer)
    ("boxed", "The total is \\boxed{18", (0, 0, 0, 0)),
    (None, "#### 18", (1, 1, 1, 1)),  # no style requested: any marker is strict, any style's format counts
    (None, "\\boxed{18}", (1, 1, 1, 1)),
    (None, "<answer>18</answer>", (1, 1, 1, 1)),
    (None, "The answer is 18.", (1, 0, 1, 0)),
]


@pytest.mark.parametrize("style,completion,expected", TABLE)
def test_score_table(style, completion, expected):
    s = score(completion, REFERENCE, style)
    assert (s.flexible, s.strict, s.extractable, s.follows_format) == tuple(bool(v) for v in expected)


@pytest.mark.parametrize("style,completion,expected", TABLE)
def test_flexible_is_the_math_reward(style, completion, expected):
    assert score(completion, REFERENCE, style).flexible == bool(math_reward([""], [completion], [REFERENCE])[0])


def test_plain_reference_and_chat_messages():
    assert score("#### 18", "18", "gsm8k") == Score(True, True, True, True)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "So \\boxed{18}."}]
    assert score(messages, "18", "boxed") == Score(True, True, True, True)


def test_no_reference_leaves_correctness_open():
    assert score("#### 18", None, "gsm8k") == Score(None, None, True, True)
    assert score("no number here", " ", "gsm8k") == Score(None, None, False, False)


def test_score_all_and_bad_input():
    got = score_all(["#### 18", "18."], ["18", "18"], "gsm8k")
    assert got == [Score(True, True, True, True), Score(True, False, True, False)]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        score_all(["a", "b"], ["18"], "gsm8k")
    with pytest.raises(ValueError, match="unknown answer style"):
        score("#### 18", "18", "hashes")


def test_requested_style_of_the_suffix():
    assert requested_style("gsm8k") == "gsm8k" and requested_style(GSM8K_SUFFIX) == "gsm8k"
    assert requested_style("boxed") == "boxed" and requested_style(BOXED_SUFFIX) == "boxed"
    assert requested_style("none") is None and requested_style(None) is None
    assert requested_style("text:Answer in one word.") is None
