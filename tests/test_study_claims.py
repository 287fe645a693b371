"""The claim-by-claim verdicts of a study (qerl.study.claims) on hand-made runs."""

import pytest

from qerl.study.claims import best_nvfp4_aqn, claims, claims_markdown, compare, paired, unpaired


def run(arm, seed, before, after, first=0.2, last=0.5, entropy=0.3):
    return {"arm": arm, "seed": seed, "pass1_before": before, "pass1_after": after, "reward_first": first,
            "reward_last": last, "metrics": [{"step": 1, "entropy": entropy}, {"step": 2, "entropy": entropy}]}


def by_name(items):
    return {c.name: c for c in items}


def test_paired_differences_use_shared_seeds_and_their_standard_error():
    runs = [run("a", 0, 0.1, 0.50), run("a", 1, 0.1, 0.60), run("a", 2, 0.1, 0.70),
            run("b", 0, 0.1, 0.40), run("b", 1, 0.1, 0.45)]
    d = paired(runs, "a", "b", "pass1_after")
    assert d["n"] == 2 and d["mean"] == pytest.approx(0.125) and d["se_paired"] == pytest.approx(0.025)
    # pooled seed spread: a's three seeds (0.5, 0.6, 0.7) and b's two (0.40, 0.45) give sqrt(0.02125 / 3)
    pooled = (0.02125 / 3) ** 0.5
    assert d["se_pooled"] == pytest.approx(pooled) and d["se"] == pytest.approx(pooled)  # the larger of the two
    assert d["a"] == pytest.approx(0.55) and d["b"] == pytest.approx(0.425)
    assert paired(runs, "a", "c", "pass1_after") is None
    one = paired([run("a", 0, 0.1, 0.5), run("b", 0, 0.1, 0.4)], "a", "b", "pass1_after")
    assert one["n"] == 1 and one["se"] is None
    growth = paired([run("a", 0, 0, 0, 0.1, 0.6), run("b", 0, 0, 0, 0.1, 0.3)], "a", "b", "reward_growth")
    assert growth["mean"] == pytest.approx(0.3)


def test_three_agreeing_seeds_do_not_make_a_difference_certain():
    # a and b agree seed by seed (paired SE 0) but other arms show how far seeds spread: the verdict follows that
    runs = [run("nvfp4+aqn", s, 0.3, 0.60 + 0.001 * s) for s in (0, 1, 2)]
    runs += [run("nvfp4", s, 0.3, 0.58 + 0.001 * s) for s in (0, 1, 2)]
    runs += [run("bf16", s, 0.3, (0.55, 0.62, 0.66)[s]) for s in (0, 1, 2)]
    d = paired(runs, "nvfp4+aqn", "nvfp4", "pass1_after")
    assert d["se_paired"] == pytest.approx(0, abs=1e-12) and d["se"] == d["se_pooled"] > 0.01
    after = by_name(claims(runs))["AQN improves held-out pass@1 after RL: nvfp4+aqn vs nvfp4"]
    assert after.verdict == "within noise" and "pooled seed spread" in after.evidence


def test_best_method_is_chosen_by_the_start_not_by_the_result():
    runs = [run("nvfp4+aqn", 0, 0.28, 0.70), run("nvfp4-awq+aqn", 0, 0.38, 0.50), run("nvfp4-awq", 0, 0.39, 0.9),
            run("nvfp4-awq+aqn@1e-4", 0, 0.5, 0.9), run("nvfp4-awq+aqn:linear", 0, 0.5, 0.9)]
    assert best_nvfp4_aqn(runs) == ["nvfp4-awq+aqn"]  # no AQN, own lr or other decay: not candidates
    assert best_nvfp4_aqn([run("bf16", 0, 0.3, 0.5)]) == []
    # every noise level of the best method stands for it, whatever their results
    levels = runs + [run("nvfp4-awq+aqn=0.1", 0, 0.38, 0.2), run("nvfp4+aqn=0.1", 0, 0.28, 0.99)]
    assert best_nvfp4_aqn(levels) == ["nvfp4-awq+aqn", "nvfp4-awq+aqn=0.1"]
    c = by_name(claims(levels + [run("bf16", 0, 0.3, 0.6)]))
    for arm in ("nvfp4-awq+aqn", "nvfp4-awq+aqn=0.1"):
        name = f"NVFP4 + AQN (best method) after RL >= 16-bit LoRA (held-out pass@1, paper Table 1): {arm}"
        assert c[name].evidence.startswith(f"pass@1 after: {arm} ")


def test_arms_without_a_shared_seed_are_compared_unpaired():
    # two studies: bf16 ran seeds 0-2, the new arm seeds 3-5; the claim still gets its numbers
    runs = [run("bf16", s, 0.30, (0.70, 0.72, 0.74)[s]) for s in (0, 1, 2)]
    runs += [run("nvfp4-awq+aqn", s, 0.39, (0.66, 0.69, 0.69)[s - 3]) for s in (3, 4, 5)]
    assert paired(runs, "nvfp4-awq+aqn", "bf16", "pass1_after") is None
    d = unpaired(runs, "nvfp4-awq+aqn", "bf16", "pass1_after")
    assert d["mean"] == pytest.approx(0.68 - 0.72) and (d["n"], d["n_b"]) == (3, 3)
    welch = ((0.0003 / 3) + (0.0004 / 3)) ** 0.5  # sample variances 0.0003 and 0.0004
    pooled = ((0.0006 + 0.0008) / 4) ** 0.5 * (2 / 3) ** 0.5
    assert d["se_welch"] == pytest.approx(welch) and d["se_pooled"] == pytest.approx(pooled)
    assert d["se"] == pytest.approx(max(welch, pooled))
    assert compare(runs, "nvfp4-awq+aqn", "bf16", "pass1_after") == d
    table1 = by_name(claims(runs))["NVFP4 + AQN (best method) after RL >= 16-bit LoRA (held-out pass@1, paper Table 1)"]
    assert table1.verdict == "does not hold"  # -0.040 with SE ~0.014: more than two errors below
    assert "unpaired: 3 and 3 seed(s), none in common" in table1.evidence and "two-sample" in table1.evidence
    assert unpaired(runs, "nvfp4-awq+aqn", "nf4", "pass1_after") is None
    single = unpaired([run("a", 0, 0, 0.5), run("b", 1, 0, 0.4)], "a", "b", "pass1_after")
    assert single["mean"] == pytest.approx(0.1) and single["se"] is None


def test_verdicts():
    seeds = (0, 1, 2)
    runs = [run("bf16", s, 0.310, 0.60 + 0.01 * s, 0.30, 0.60, 0.25) for s in seeds]
    runs += [run("nf4", s, 0.320, 0.50 + 0.01 * s, 0.30, 0.55, 0.25) for s in seeds]
    # AWQ + AQN: starts within 0.01, ends level with bf16 within noise, AQN raises entropy clearly
    runs += [run("nvfp4-awq+aqn", s, 0.305, (0.62, 0.55, 0.63)[s], 0.30, 0.60, 0.35 + 0.01 * s) for s in seeds]
    runs += [run("nvfp4-awq", s, 0.305, (0.60, 0.58, 0.64)[s], 0.30, 0.62, 0.25) for s in seeds]
    c = by_name(claims(runs))
    assert c["NVFP4 awq starts no more than 0.01 below bf16 (held-out pass@1 before RL)"].verdict == "holds"
    assert sum(name.startswith("NVFP4 awq starts") for name in c) == 1  # one claim per method, AQN or not
    table1 = c["NVFP4 + AQN (best method) after RL >= 16-bit LoRA (held-out pass@1, paper Table 1)"]
    assert table1.verdict == "within noise" and "-0.010" in table1.evidence  # (0.02 - 0.06 + 0.01) / 3
    assert c["NVFP4 + AQN (best method) after RL >= NF4 QLoRA (held-out pass@1, paper Table 1)"].verdict == "holds"
    ent = c["AQN raises the policy's entropy (mean over steps): nvfp4-awq+aqn vs nvfp4-awq"]
    assert ent.verdict == "holds" and "+0.110" in ent.evidence
    growth = c["AQN speeds reward growth (last 20% minus first 20% of steps): nvfp4-awq+aqn vs nvfp4-awq"]
    assert growth.verdict == "does not hold"  # -0.02 on every seed: no spread, a clear loss
    assert "(first 20% of steps 0.300 vs 0.300, last 20% 0.600 vs 0.620)" in growth.evidence  # where it came from
    assert c["the exponential AQN decay beats linear / cosine / logarithmic"].verdict == "not measured"
    md = claims_markdown(claims(runs))
    assert md.count("\n- ") == len(c) - 1 and "**within noise**" in md


def test_a_start_below_the_margin_does_not_hold_and_missing_arms_are_not_measured():
    runs = [run("bf16", 0, 0.31, 0.6), run("nvfp4+aqn", 0, 0.28, 0.6), run("nvfp4+aqn:linear", 0, 0.28, 0.5)]
    c = by_name(claims(runs))
    assert c["NVFP4 rtn starts no more than 0.01 below bf16 (held-out pass@1 before RL)"].verdict == "does not hold"
    claim = "NVFP4 + AQN (best method) after RL >= NF4 QLoRA (held-out pass@1, paper Table 1)"
    assert c[claim].verdict == "not measured"
    assert c["the exponential AQN decay at least as good as linear"].verdict == "holds"
    assert not any(name.startswith("AQN ") for name in c)  # no arm without AQN to compare with
    assert claims([]) and all(x.verdict == "not measured" for x in claims([]))
    ahead = by_name(claims([run("bf16", 0, 0.30, 0.6), run("nvfp4-awq", 0, 0.39, 0.6), run("nvfp4", 0, 0.295, 0.6)]))
    assert ahead["NVFP4 awq starts no more than 0.01 below bf16 (held-out pass@1 before RL)"].verdict == "holds"
    assert ahead["NVFP4 rtn starts no more than 0.01 below bf16 (held-out pass@1 before RL)"].verdict == "holds"


def test_a_decay_is_compared_with_the_exponential_arm_of_the_same_noise_level():
    runs = [run("nvfp4+aqn", 0, 0.3, 0.50), run("nvfp4+aqn=0.05", 0, 0.3, 0.70),
            run("nvfp4+aqn=0.05:linear", 0, 0.3, 0.60), run("nvfp4+aqn:linear", 0, 0.3, 0.55)]
    c = by_name(claims(runs))
    at_005 = c["the exponential AQN decay at least as good as linear: nvfp4+aqn=0.05:linear"]
    assert at_005.verdict == "holds" and "nvfp4+aqn=0.05 0.700 vs nvfp4+aqn=0.05:linear 0.600" in at_005.evidence
    paper = c["the exponential AQN decay at least as good as linear: nvfp4+aqn:linear"]
    assert paper.verdict == "does not hold" and "nvfp4+aqn 0.500 vs nvfp4+aqn:linear 0.550" in paper.evidence
    alone = by_name(claims([run("nvfp4+aqn=0.1", 0, 0.3, 0.6), run("nvfp4+aqn:cosine", 0, 0.3, 0.6)]))
    assert alone["the exponential AQN decay at least as good as cosine"].verdict == "not measured"  # no σ 1e-2 twin


def test_table_1_on_the_16bit_base_when_the_study_measured_it():
    # the 4-bit arm ends below bf16 on its own base, level on the 16-bit one: two claims, two verdicts
    runs = []
    for s in (0, 1, 2):
        runs.append({**run("bf16", s, 0.30, 0.72 + 0.01 * s), "pass1_after_16bit": 0.72 + 0.01 * s})
        runs.append({**run("nvfp4+aqn", s, 0.30, 0.62 + 0.01 * s), "pass1_after_16bit": 0.725 + 0.01 * s})
    c = by_name(claims(runs))
    own = c["NVFP4 + AQN (best method) after RL >= 16-bit LoRA (held-out pass@1, paper Table 1)"]
    served = c["NVFP4 + AQN (best method) adapter on the 16-bit base after RL >= 16-bit LoRA (held-out pass@1, "
               "paper Table 1)"]
    assert own.verdict == "does not hold" and served.verdict == "holds"
    assert "pass@1 after, 16-bit base: nvfp4+aqn 0.735 vs bf16 0.730, difference +0.005" in served.evidence
    assert not any("16-bit base" in name for name in by_name(claims([run("bf16", 0, 0.3, 0.7),
                                                                    run("nvfp4+aqn", 0, 0.3, 0.6)])))
