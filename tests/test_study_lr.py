"""A learning-rate sweep read from a study's runs (qerl.study.lr) on hand-made runs."""

from qerl.study.lr import best_lrs, lr_groups, lr_sweep_markdown


def run(arm, seed, reward_last, reward_first=0.2, after=None):
    return {"arm": arm, "seed": seed, "reward_first": reward_first, "reward_last": reward_last,
            "entropy_last": 0.1, "pass1_after": after, "metrics": []}


def test_groups_are_the_arms_that_differ_only_in_their_rate():
    runs = [run("nvfp4+aqn@1e-4", 0, 0.5), run("nvfp4+aqn@2e-5", 0, 0.4), run("nvfp4+aqn@1e-4", 1, 0.6),
            run("bf16@5e-5", 0, 0.7), run("bf16", 0, 0.9), run("nvfp4-awq+aqn@1e-4", 0, 0.3)]
    groups = lr_groups(runs)
    assert list(groups) == ["nvfp4+aqn", "bf16", "nvfp4-awq+aqn"]  # an arm without @LR is in no group
    assert list(groups["nvfp4+aqn"]) == [2e-5, 1e-4]  # ascending
    assert [r["seed"] for r in groups["nvfp4+aqn"][1e-4]] == [0, 1]


def test_the_rate_with_the_best_late_reward_over_seeds_is_picked():
    runs = [run("nf4@1e-4", 0, 0.80), run("nf4@1e-4", 1, 0.40),  # mean 0.60
            run("nf4@5e-5", 0, 0.62), run("nf4@5e-5", 1, 0.62),  # mean 0.62: best, though seed 0 is lower
            run("nf4@2e-5", 0, 0.62), run("nf4@2e-5", 1, 0.62),  # tie with 5e-5: the smaller rate
            run("bf16@1e-4", 0, None), run("bf16@2e-4", 0, 0.1)]
    assert best_lrs(runs) == {"nf4": 2e-5, "bf16": 2e-4}  # a run without a reward does not count
    md = lr_sweep_markdown(runs)
    assert "| nf4 | **2e-05** | 2 | 0.620 ± 0.000 |" in md and "| nf4 | 0.0001 | 2 | 0.600 ± 0.283 |" in md
    assert "| bf16 | 0.0001 | 1 | - |" in md  # missing reward shown as "-", not 0
    assert md.count("**") == 4  # one pick per group
    assert "One seed at some rate" in md  # bf16's rates ran one seed each
    assert "One seed" not in lr_sweep_markdown([r for r in runs if r["arm"].startswith("nf4")])


def test_no_rate_no_group():
    assert lr_groups([run("bf16", 0, 0.5)]) == {} and best_lrs([]) == {}
