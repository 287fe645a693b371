"""Completion-length profiles (`qerl.data.length_profiles`): files, validation, named profiles, group-wise draws,
and the two tools that make profiles (`benchmarks/record_lengths.py` on a tiny model, `make_long_profile.py`)."""

import json

import pytest

from qerl.data.length_profiles import (NAMED, LengthProfile, ProfileError, describe, draw, load_profile,
                                        packaged_path, read_profile, summary, to_json)

from bench_scripts import load_benchmark as _bench


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


# files and validation ---------------------------------------------------------------------------------------


def test_json_profile_round_trips(tmp_path):
    p = LengthProfile("toy", 10, (1, 2, 10, 4, 5, 6), "made up", group_size=3)
    path = _write(tmp_path, "toy.json", to_json(p))
    assert read_profile(path) == p and load_profile(str(path)) == p
    assert json.loads(path.read_text())["lengths"] == [1, 2, 10, 4, 5, 6]


def test_text_profile_reads_ints_comments_and_the_budget(tmp_path):
    path = _write(tmp_path, "lens.txt", "# measured somewhere\n# max_new_tokens: 64\n12\n\n 40 \n64\n")
    p = read_profile(path)
    assert p.lengths == (12, 40, 64) and p.max_new_tokens == 64 and p.name == "lens" and p.group_size is None
    assert read_profile(_write(tmp_path, "plain.txt", "3\n7\n")).max_new_tokens == 7  # default: the longest


@pytest.mark.parametrize("text,match", [
    ("", "no lengths"),
    ("# only a comment\n", "no lengths"),
    ("12\ntwelve\n", "line 2 is not an int: 'twelve'"),
    ("1.5\n", "line 1 is not an int"),
    ("# max_new_tokens: 8\n4\n9\n9\n", r"length #1 = 9 is outside \[1, max_new_tokens = 8\]"),
    ("0\n3\n", r"length #0 = 0 is outside"),
    ("-2\n", "outside"),
    ("# max_new_tokens: lots\n4\n", "max_new_tokens is not an int"),
])
def test_bad_text_files_are_refused_with_the_reason(tmp_path, text, match):
    with pytest.raises(ProfileError, match=match):
        read_profile(_write(tmp_path, "bad.txt", text))


@pytest.mark.parametrize("obj,match", [
    ({"name": "x", "max_new_tokens": 8, "lengths": []}, "no lengths"),
    ({"name": "x", "max_new_tokens": 8, "lengths": [1, "2"]}, "length #1 is not an int"),
    ({"name": "x", "max_new_tokens": 8, "lengths": [1, 2.0]}, "length #1 is not an int"),
    ({"name": "x", "max_new_tokens": 8, "lengths": [1, True]}, "length #1 is not an int"),
    ({"name": "x", "max_new_tokens": 8, "lengths": [9]}, "outside"),
    ({"name": "x", "max_new_tokens": 0, "lengths": [1]}, "max_new_tokens must be a positive int"),
    ({"name": "x", "lengths": [1]}, "an object with"),
    ({"name": "x", "max_new_tokens": 8, "lengths": 5}, "must be a list"),
    ({"name": "x", "max_new_tokens": 8, "lengths": [1, 2, 3], "group_size": 2}, "group_size 2 must be"),
    ([1, 2, 3], "an object with"),
])
def test_bad_json_files_are_refused_with_the_reason(tmp_path, obj, match):
    with pytest.raises(ProfileError, match=match):
        read_profile(_write(tmp_path, "bad.json", json.dumps(obj)))


def test_unreadable_or_broken_json_is_refused(tmp_path):
    with pytest.raises(ProfileError, match="not JSON"):
        read_profile(_write(tmp_path, "broken.json", '{"lengths": [1,'))
    with pytest.raises(ProfileError, match="cannot read it"):
        read_profile(tmp_path / "missing.txt")


# named profiles ---------------------------------------------------------------------------------------------


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ProfileError, match="neither a file nor a named length profile .*long-reasoning-4096"):
        load_profile("no-such-profile")


def test_a_named_profile_not_recorded_yet_says_how_to_record_it(monkeypatch, tmp_path):
    import qerl.data.length_profiles as lp

    monkeypatch.setattr(lp, "packaged_path", lambda name: tmp_path / f"{name}.json")  # an empty profiles folder
    with pytest.raises(ProfileError, match="not recorded yet .*benchmarks/record_lengths.py Qwen/Qwen2.5-Coder"):
        load_profile("gsm8k-qwen2.5-coder-1.5b")


@pytest.mark.parametrize("name", sorted(NAMED))
def test_shipped_named_profiles_are_valid(name):
    if not packaged_path(name).is_file():
        pytest.skip(f"{name} is not recorded in this checkout ({NAMED[name]})")
    p = load_profile(name)
    assert p.name == name and p.source and len(p.lengths) >= 8


# draws ------------------------------------------------------------------------------------------------------

GROUPED = LengthProfile("g", 100, (1, 2, 3, 4, 10, 20, 30, 40, 50, 60, 70, 100), "test", group_size=4)


def test_draws_repeat_for_a_seed_and_change_with_it():
    a = draw(GROUPED, 16, 4, seed=3)
    assert a == draw(GROUPED, 16, 4, seed=3) and len(a) == 16
    assert any(draw(GROUPED, 16, 4, seed=s) != a for s in range(4, 8))


def test_each_drawn_group_is_one_measured_group():
    groups = {tuple(sorted(g)) for g in GROUPED.groups}
    for seed in range(20):
        rows = draw(GROUPED, 12, 4, seed)
        assert all(tuple(sorted(rows[i:i + 4])) in groups for i in range(0, 12, 4))


def test_smaller_and_larger_groups_stay_within_one_measured_group():
    by_value = {n: i for i, g in enumerate(GROUPED.groups) for n in g}
    for seed in range(20):
        small = draw(GROUPED, 6, 2, seed)  # 2 of a measured group's 4 rows, no row twice
        for i in range(0, 6, 2):
            assert by_value[small[i]] == by_value[small[i + 1]] and small[i] != small[i + 1]
        big = draw(GROUPED, 10, 10, seed)  # two whole copies + 2 more rows of the same group
        assert len({by_value[n] for n in big}) == 1
        assert all(big.count(n) in (2, 3) for n in set(big))


def test_independent_rows_draw_each_row_from_the_pool():
    p = LengthProfile("i", 9, (1, 5, 9), "test")
    rows = draw(p, 30, 3, seed=1)
    assert set(rows) <= {1, 5, 9} and len(set(rows)) > 1 and rows == draw(p, 30, 3, seed=1)


@pytest.mark.parametrize("n_rows,group", [(10, 4), (0, 2), (4, 0)])
def test_draw_refuses_rows_that_are_not_whole_groups(n_rows, group):
    with pytest.raises(ValueError, match="multiple of group_size"):
        draw(GROUPED, n_rows, group, seed=0)


def test_summary_and_description():
    s = summary([1, 2, 3, 100, 100], 100)
    assert s["mean"] == pytest.approx(41.2) and s["median"] == 3 and s["max"] == 100 and s["truncated"] == 0.4
    assert describe(GROUPED) == ("g (max 100): 12 rows, 3 groups of 4; mean 32, median 25, p90 70, at the "
                                 "budget 8.3%")


# the tools that make profiles -------------------------------------------------------------------------------


def test_record_lengths_writes_a_grouped_profile_from_real_rollouts(tiny_dir, tmp_path, capsys):
    """A tiny random model (character tokenizer) on GSM8K: 2 prompts x 3 completions, each row's length its
    completion_mask sum; the file loads as a profile of 2 groups of 3."""
    mod = _bench("record_lengths")
    out = tmp_path / "p.json"
    assert mod.main([str(tiny_dir), "--out", str(out), "--prompts", "2", "--group", "3", "--max-new-tokens", "6",
                     "--max-prompt-tokens", "400", "--format", "nvfp4", "--lora-r", "4", "--device", "cpu"]) == 0
    p = read_profile(out)
    assert p.name == "gsm8k-qwen2.5-coder-1.5b" and p.group_size == 3 and len(p.lengths) == 6
    assert p.max_new_tokens == 6 and all(1 <= n <= 6 for n in p.lengths)
    assert "gsm8k-offline (test split) 2 prompts (seed 0) x 3 completions" in p.source
    assert "2 groups of 3" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # never overwrites a recorded profile by accident
        mod.parse_args([str(tiny_dir), "--out", str(out)])


def test_record_lengths_refuses_more_prompts_than_fit():
    mod = _bench("record_lengths")
    with pytest.raises(ValueError, match="--prompts 5 exceeds the 3 problems"):
        mod.pick_prompts([{"question": "q"}] * 3, 5, seed=0)
    first, second = ([{"i": i} for i in range(10)] for _ in range(2))
    assert mod.pick_prompts(first, 4, 1) == mod.pick_prompts(second, 4, 1)


def test_the_long_profile_is_the_seeded_fit_to_its_published_figures(tmp_path):
    """make_long_profile.py reproduces the shipped file byte for byte; the fit has the source's median and p99
    before the budget, and the budget's point mass is the expected share."""
    mod = _bench("make_long_profile")
    out = tmp_path / "long.json"
    assert mod.main(["--out", str(out)]) == 0
    shipped = packaged_path("long-reasoning-4096")
    assert shipped.is_file() and out.read_text() == shipped.read_text()
    p = load_profile("long-reasoning-4096")
    assert p.max_new_tokens == 4096 and len(p.lengths) == 4096 and p.group_size is None
    assert mod.SOURCE_URL in p.source and "Not a measured run" in p.source
    s = summary(p.lengths, 4096)
    assert 450 <= s["median"] <= 550  # median 500
    assert mod.truncated_share(500, 5000, 4096) == pytest.approx(0.0168, abs=1e-4)
    assert 0.012 <= s["truncated"] <= 0.024  # 4096 rows: the 1.7% point mass within ~3 standard errors
    wide = mod.clipped_lognormal(500, 5000, 10**9, 20000, seed=1)  # no budget: check the p99 of the fit
    assert 4300 <= sorted(wide)[int(0.99 * len(wide))] <= 5800
