"""Rewards: real math-verify on the answer styles models produce, and the runner's failure handling."""

import math
import threading
import time

import pytest

from qerl.rewards import RewardRunner, follows_format, get_reward, make_format_reward, math_reward, reference_answer
from qerl.rewards.extract import final_answer

GSM_REF = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"


@pytest.mark.parametrize("completion, answer", [
    ("She sold 24 in May, so 48 + 24 = 72.\n#### 72", GSM_REF),
    ("The total is $\\boxed{72}$.", GSM_REF),
    ("<answer>72</answer>", GSM_REF),
    ("#### 1,234", "1234"),
    ("\\boxed{1,234}", "#### 1,234"),
    ("#### $18.", "18"),
    ("\\boxed{18 \\text{ dollars}}", "18"),
    ("The answer is 18 dollars", "18"),
    ("#### 12.0", "12"),
    ("\\boxed{12.00}", "12"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("<answer> 0.5 </answer>", "\\frac{1}{2}"),
    ("First \\boxed{5}, no wait: \\boxed{7}", "7"),
    ("#### 5\nActually I was wrong.\n#### 7", "7"),
    ("so the answer is 7", "\\boxed{7}"),
])
def test_math_reward_correct(completion, answer):
    assert math_reward(["q"], [completion], [answer]) == [1.0]


@pytest.mark.parametrize("completion, answer", [
    ("#### 71", GSM_REF),
    ("", GSM_REF),
    ("First \\boxed{5}, no wait: \\boxed{7}", "5"),  # the last answer counts
    ("<answer>72</answer> ... #### 70", "72"),
    ("I don't know", "3"),
    ("\\boxed{7", "8"),  # unclosed box, no other number
])
def test_math_reward_wrong(completion, answer):
    assert math_reward(["q"], [completion], [answer]) == [0.0]


def test_math_reward_no_reference_is_none_and_missing_column_raises():
    assert math_reward(["q", "q"], ["#### 1", "#### 1"], [None, " "]) == [None, None]
    with pytest.raises(KeyError, match="answer"):
        math_reward(["q"], ["#### 1"])


def test_math_reward_chat_completions():
    assert math_reward(["q"], [[{"role": "assistant", "content": "#### 4"}]], ["4"]) == [1.0]


def test_strict_math_reward_needs_a_marker():
    strict = get_reward("math_strict")
    assert strict(["q"], ["so it is 7"], ["7"]) == [0.0]
    assert strict(["q"], ["so it is \\boxed{7}"], ["7"]) == [1.0]


def test_reference_answer():
    assert reference_answer(GSM_REF) == "72"
    assert reference_answer("so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert reference_answer(" 70 ") == "70"


def test_final_answer_picks_the_last_marker():
    text = "#### 1 then \\boxed{2} then <answer>3</answer> and \\boxed{4}"
    f = final_answer(text)
    assert (f.style, f.text) == ("boxed", "4")
    assert final_answer("nothing here") is None


@pytest.mark.parametrize("style, completion, ok", [
    ("gsm8k", "work...\n#### 42", True),
    ("gsm8k", "#### 42\n", True),
    ("gsm8k", "#### 42\nMore text after the answer.", False),
    ("gsm8k", "\\boxed{42}", False),
    ("gsm8k", "#### ", False),
    ("boxed", "so $\\boxed{42}$.", True),
    ("boxed", "\\boxed{42} is what I think, but", False),
    ("answer_tag", "<think>..</think><answer>42</answer>", True),
    ("answer_tag", "<answer>forty</answer>", False),  # nothing math-verify can parse
    ("any", "\\boxed{x^2}", True),
    ("any", "The answer is 42", False),
    ("any", "", False),
])
def test_format_reward(style, completion, ok):
    assert follows_format(completion, style) is ok
    assert make_format_reward(style)(["q"], [completion]) == [float(ok)]


def test_registry():
    assert get_reward("math") is math_reward
    assert get_reward("format")(["q"], ["#### 3"]) == [1.0]
    with pytest.raises(KeyError, match="math, math_strict"):
        get_reward("nope")
    with pytest.raises(ValueError, match="unknown answer style"):
        make_format_reward("latex")


# ---------------------------------------------------------------- runner (functions at module level: picklable)


def hangs(prompts, completions, **columns):
    time.sleep(60)
    return [1.0] * len(completions)


def raises(prompts, completions, **columns):
    raise RuntimeError("user bug")


def wrong_length(prompts, completions, **columns):
    return [1.0]


def nan_and_text(prompts, completions, **columns):
    return [float("nan"), float("inf"), "1.0", 0.5][: len(completions)]


def only_first(prompts, completions, **columns):
    return [2.0] + [None] * (len(completions) - 1)


def echo_column(prompts, completions, level=None, **columns):
    return [float(v) for v in level]


PROMPTS, COMPLETIONS, ANSWERS = ["q"] * 4, ["#### 1", "#### 2", "\\boxed{3}", "no idea"], ["1", "5", "3", "4"]


@pytest.fixture(scope="module")
def runner_pool():
    runners = []

    def make(*args, **kwargs):
        runners.append(RewardRunner(*args, **kwargs))
        return runners[-1]

    yield make
    for r in runners:
        r.close()


@pytest.mark.parametrize("isolation", ["process", "thread", "inline"])
def test_runner_weighted_sum(runner_pool, isolation):
    runner = runner_pool([math_reward, get_reward("format"), echo_column], [1.0, 0.5, 0.1], timeout_s=30,
                         isolation=isolation)
    rewards, per_func, stats = runner.score(PROMPTS, COMPLETIONS, {"answer": ANSWERS, "level": [1, 2, 3, 4]})
    assert per_func["math"] == [1.0, 0.0, 1.0, 0.0]
    assert per_func["format"] == [1.0, 1.0, 1.0, 0.0]
    assert rewards == pytest.approx([1.6, 0.7, 1.8, 0.4])
    assert stats["reward/math"] == 0.5 and stats["reward_errors/math"] == 0 and stats["reward/unscored_rows"] == 0


def test_runner_none_is_excluded_and_all_none_rows_are_counted(runner_pool, caplog):
    runner = runner_pool([only_first, math_reward], timeout_s=30)
    rewards, per_func, stats = runner.score(PROMPTS, COMPLETIONS, {"answer": ["1", None, None, "4"]})
    assert per_func["only_first"] == [2.0, None, None, None]
    assert per_func["math"] == [1.0, None, None, 0.0]
    assert rewards == [3.0, 0.0, 0.0, 0.0]
    assert stats["reward/unscored_rows"] == 2  # rows 1, 2: no function applies -> 0.0, counted
    assert stats["reward_errors/only_first"] == 0 and "no reward from any function" in caplog.text


def test_runner_catches_raise_wrong_length_and_nan(runner_pool, caplog):
    runner = runner_pool([raises, wrong_length, nan_and_text, math_reward], timeout_s=30)
    rewards, per_func, stats = runner.score(PROMPTS, COMPLETIONS, {"answer": ANSWERS})
    assert per_func["raises"] == [None] * 4 and stats["reward_errors/raises"] == 4
    assert per_func["wrong_length"] == [None] * 4 and stats["reward_errors/wrong_length"] == 4
    assert per_func["nan_and_text"] == [None, None, None, 0.5] and stats["reward_errors/nan_and_text"] == 3
    assert rewards == [1.0, 0.0, 1.0, 0.5]  # the healthy math reward still counts
    assert "RuntimeError: user bug" in runner.last_errors["raises"]
    assert "length 1" in runner.last_errors["wrong_length"]
    assert "reward raises: 4 of 4 rows failed" in caplog.text


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_runner_bounds_a_hanging_function(runner_pool, isolation):
    runner = runner_pool([hangs, math_reward], timeout_s=1.5, isolation=isolation)
    t0 = time.monotonic()
    rewards, per_func, stats = runner.score(PROMPTS, COMPLETIONS, {"answer": ANSWERS})
    assert time.monotonic() - t0 < 30  # the function sleeps 60 s: it was cut off, not awaited
    assert per_func["hangs"] == [None] * 4 and stats["reward_errors/hangs"] == 4
    assert "timed out" in runner.last_errors["hangs"]
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    if isolation == "process":  # the hung worker was killed; the next call starts a fresh one and works
        runner.funcs[0], runner.names[0] = math_reward, "math2"
        rewards, per_func, _ = runner.score(PROMPTS, COMPLETIONS, {"answer": ANSWERS})
        assert per_func["math2"] == [1.0, 0.0, 1.0, 0.0]


def test_runner_off_the_main_thread(runner_pool):
    """math-verify's signal.alarm cannot run off the main thread: scoring from a thread must still work."""
    out = {}
    for isolation in ("process", "thread", "inline"):
        runner = runner_pool([math_reward], timeout_s=30, isolation=isolation)
        t = threading.Thread(target=lambda: out.update({isolation: runner.score(PROMPTS, COMPLETIONS,
                                                                                {"answer": ANSWERS})}))
        t.start(), t.join()
        assert out[isolation][1]["math"] == [1.0, 0.0, 1.0, 0.0], isolation


def test_runner_unpicklable_function_runs_in_a_thread(runner_pool, caplog):
    runner = runner_pool([lambda prompts, completions, **kw: [0.25] * len(completions)], timeout_s=10)
    rewards, _, _ = runner.score(PROMPTS, COMPLETIONS, {})
    assert rewards == [0.25] * 4 and "not picklable" in caplog.text


def test_runner_bad_arguments():
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        RewardRunner([math_reward, raises], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        RewardRunner([])
    runner = RewardRunner([math_reward], isolation="inline")
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 4"):
        runner.score(PROMPTS, COMPLETIONS, {"answer": ["1"]})


def test_runner_large_batch_round_trip(runner_pool):
    """512 long rows through a worker process come back complete and in order (the runner's overhead,
    about 1 ms for this batch on the dev machine, is a benchmark figure, not asserted here)."""
    runner = runner_pool([echo_column], timeout_s=30)
    n = 512
    cols = {"level": list(range(n)), "answer": ["#### 3"] * n}
    runner.score(["p" * 300] * n, ["c" * 600] * n, cols)  # starts the worker
    rewards, _, _ = runner.score(["p" * 300] * n, ["c" * 600] * n, cols)
    assert rewards == [float(i) for i in range(n)] and not any(math.isnan(r) for r in rewards)


SLOW_IMPORT = '''
import time

time.sleep(2.0)  # a heavy user module (torch, a tokenizer, a verifier) takes seconds to import


def one(prompts, completions, **columns):
    return [1.0] * len(completions)
'''


def test_runner_imports_a_slow_module_before_the_first_call_is_timed(runner_pool, tmp_path, monkeypatch):
    """The worker imports the function's module while it starts, so a 2 s import does not use up a 1 s
    reward timeout on the first call (it did when the import happened while unpickling the call)."""
    (tmp_path / "slow_import_reward.py").write_text(SLOW_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    from slow_import_reward import one

    runner = runner_pool([one], timeout_s=1.0)
    rewards, _, stats = runner.score(PROMPTS, COMPLETIONS)
    assert list(rewards) == [1.0] * 4 and stats["reward_errors/one"] == 0
