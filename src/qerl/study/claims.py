"""The paper's claims checked against a study's finished runs (docs/results.md, "Claim by claim").

Each claim names the arms it compares, the numbers that decide it and a verdict. Arms are compared seed by seed
(the same seed gives the same data order and LoRA initialisation in every arm), so a difference comes with the
standard error of its per-seed values; a difference within two standard errors reads "within noise". With three
seeds that paired error is itself a guess from two degrees of freedom (two arms whose three seeds happen to agree
give a tiny one), so the error used is the larger of it and the error of a difference of two means computed from
the seed-to-seed spread pooled over every arm of the study. Arms that share no seed (run in different studies) are
compared unpaired: the difference of their means, with the larger of the two-sample (Welch) and the pooled error.
"The best method" is decided before training: the NVFP4 method whose AQN arm has the highest held-out pass@1 before
RL (what a user would pick from `benchmarks/quant_methods.py`), never by the result after it; every AQN arm of
that method (one per noise level) gets its own Table 1 claims.

    claims(runs) -> [Claim]; claims_markdown(claims) -> str
"""

import math
import statistics
from dataclasses import dataclass

from .arms import DEFAULT_DECAY, parse_arm


@dataclass
class Claim:
    name: str  # what the paper says
    verdict: str  # holds | does not hold | within noise | not measured
    evidence: str  # the numbers, one line


def _mean_entropy(run: dict) -> float | None:
    """The run's token entropy averaged over every step (the paper's exploration diagnostic)."""
    values = [m["entropy"] for m in run.get("metrics", []) if m.get("entropy") is not None]
    return statistics.fmean(values) if values else None


def _reward_growth(run: dict) -> float | None:
    """Mean training reward of the last 20% of steps minus that of the first 20%."""
    if run.get("reward_last") is None or run.get("reward_first") is None:
        return None
    return run["reward_last"] - run["reward_first"]


DERIVED = {"entropy_mean": _mean_entropy, "reward_growth": _reward_growth}


def values(runs: list[dict], arm: str, key: str) -> dict[int, float]:
    """{seed: the run's value} for `arm`; key is a result.json field or one of DERIVED."""
    get = DERIVED.get(key, lambda r: r.get(key))
    out = {r["seed"]: get(r) for r in runs if r["arm"] == arm}
    return {s: float(v) for s, v in out.items() if v is not None and not math.isnan(float(v))}


def pooled_std(runs: list[dict], key: str) -> tuple[float | None, int]:
    """(the seed-to-seed standard deviation of `key` pooled over every arm with two or more seeds, how many arms
    that is); (None, 0) when no arm has two seeds."""
    ss, dof, arms = 0.0, 0, 0
    for arm in dict.fromkeys(r["arm"] for r in runs):
        xs = list(values(runs, arm, key).values())
        if len(xs) > 1:
            mean = statistics.fmean(xs)
            ss += sum((x - mean) ** 2 for x in xs)
            dof += len(xs) - 1
            arms += 1
    return (math.sqrt(ss / dof), arms) if dof else (None, 0)


def paired(runs: list[dict], a: str, b: str, key: str) -> dict | None:
    """Arm a minus arm b on `key` over the seeds both finished: {"mean", "n", "a", "b" (the arms' means on those
    seeds), "se_paired" (from the per-seed differences), "se_pooled" (pooled std * sqrt(2 / n)), "se" (the larger;
    None for one seed)}; None when they share no seed."""
    va, vb = values(runs, a, key), values(runs, b, key)
    seeds = sorted(va.keys() & vb.keys())
    if not seeds:
        return None
    diffs = [va[s] - vb[s] for s in seeds]
    n = len(diffs)
    se_paired = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else None
    std, _ = pooled_std(runs, key)
    se_pooled = std * math.sqrt(2 / n) if std is not None and n > 1 else None
    se = max((x for x in (se_paired, se_pooled) if x is not None), default=None)
    return {"mean": statistics.fmean(diffs), "se": se, "se_paired": se_paired, "se_pooled": se_pooled, "n": n,
            "a": statistics.fmean(va[s] for s in seeds), "b": statistics.fmean(vb[s] for s in seeds)}


def unpaired(runs: list[dict], a: str, b: str, key: str) -> dict | None:
    """Arm a minus arm b on `key` from every seed of each (for arms that share none): {"mean", "n" (a's seeds),
    "n_b", "a", "b" (the arms' means), "se_welch" (sqrt(var_a / n_a + var_b / n_b)), "se_pooled" (pooled std *
    sqrt(1 / n_a + 1 / n_b)), "se" (the larger of those that exist; None when no arm of the study has two seeds),
    "unpaired": True}; None when an arm has no value."""
    va, vb = list(values(runs, a, key).values()), list(values(runs, b, key).values())
    if not va or not vb:
        return None
    na, nb = len(va), len(vb)
    se_welch = math.sqrt(statistics.variance(va) / na + statistics.variance(vb) / nb) if min(na, nb) > 1 else None
    std, _ = pooled_std(runs, key)
    se_pooled = std * math.sqrt(1 / na + 1 / nb) if std is not None else None
    se = max((x for x in (se_welch, se_pooled) if x is not None), default=None)
    return {"mean": statistics.fmean(va) - statistics.fmean(vb), "se": se, "se_welch": se_welch,
            "se_pooled": se_pooled, "n": na, "n_b": nb, "a": statistics.fmean(va), "b": statistics.fmean(vb),
            "unpaired": True}


def compare(runs: list[dict], a: str, b: str, key: str) -> dict | None:
    """`paired` over the seeds both arms finished, or `unpaired` when they share none."""
    return paired(runs, a, b, key) or unpaired(runs, a, b, key)


SE_SOURCES = (("se_paired", "paired by seed"), ("se_welch", "two-sample"), ("se_pooled", "from the pooled seed spread"))


def diff_text(d: dict, a: str, b: str, what: str) -> str:
    """One line for a `paired` or `unpaired` difference: the means, the difference, its SE and where the SE came
    from."""
    parts = [f"{d[k]:.3f} {label}" for k, label in SE_SOURCES if d.get(k) is not None]
    se = "" if d["se"] is None else f" ± {d['se']:.3f} (SE, " + (
        f"the larger of {' and '.join(parts)})" if len(parts) > 1 else f"{parts[0]})")
    seeds = (f", unpaired: {d['n']} and {d['n_b']} seed(s), none in common" if d.get("unpaired")
             else f" over {d['n']} seed(s)")
    return f"{what}: {a} {d['a']:.3f} vs {b} {d['b']:.3f}, difference {d['mean']:+.3f}{se}{seeds}"


def _at_least(d: dict | None, margin: float = 0.0) -> str:
    """Verdict for "a >= b - margin" from a paired difference."""
    if d is None:
        return "not measured"
    if d["mean"] >= -margin:
        return "holds"
    if d["se"] is not None and d["mean"] + 2 * d["se"] >= -margin:
        return "within noise"
    return "does not hold"


def _arms(runs: list[dict]) -> dict[str, object]:
    return {r["arm"]: parse_arm(r["arm"]) for r in runs}


def best_nvfp4_aqn(runs: list[dict]) -> list[str]:
    """The NVFP4 + AQN arms (default decay, no own lr) of the method with the best held-out pass@1 before RL: one
    per noise level, in the order they first appear; [] when there is none."""
    arms = _arms(runs)
    candidates = [name for name, arm in arms.items()
                  if arm.format == "nvfp4" and arm.aqn and arm.decay == DEFAULT_DECAY and arm.lr is None]
    before = {name: statistics.fmean(values(runs, name, "pass1_before").values() or [float("-inf")])
              for name in candidates}
    best = max(candidates, key=lambda name: (before[name], name), default=None)
    return [name for name in candidates if best is not None and arms[name].method == arms[best].method]


def _without_aqn(runs: list[dict], name: str) -> str | None:
    arm = parse_arm(name)
    twin = [n for n, a in _arms(runs).items()
            if (a.format, a.method, a.lr, a.aqn) == (arm.format, arm.method, arm.lr, False)]
    return twin[0] if twin else None


def _growth_ends(runs: list[dict], a: str, b: str) -> str:
    """Where a reward-growth difference comes from: the two ends' means. The AQN arms' early rollouts carry the
    most noise, so a larger growth can be a lower start (the noise's own cost) rather than a higher end."""
    first, last = compare(runs, a, b, "reward_first"), compare(runs, a, b, "reward_last")
    if first is None or last is None:
        return ""
    return (f" (first 20% of steps {first['a']:.3f} vs {first['b']:.3f}, last 20% {last['a']:.3f} vs "
            f"{last['b']:.3f})")


def claims(runs: list[dict]) -> list[Claim]:
    arms = _arms(runs)
    best_arms = best_nvfp4_aqn(runs)
    bf16 = next((n for n, a in arms.items() if a.format == "bf16" and not a.aqn and a.lr is None), None)
    nf4 = next((n for n, a in arms.items() if a.format == "nf4" and not a.aqn and a.lr is None), None)
    out = []

    # starting point: each NVFP4 method's policy before RL, greedy held-out pass@1 (the target: no more
    # than 0.01 below bf16; the start does not depend on AQN or the lr, so one arm per method stands for it)
    starts = {}
    for name, arm in sorted(arms.items()):
        if arm.format == "nvfp4":
            starts.setdefault(arm.method, name)
    claim = "NVFP4 {} starts no more than 0.01 below bf16 (held-out pass@1 before RL)"
    if not starts or bf16 is None:
        out.append(Claim(claim.format("(any method)"), "not measured", "needs a bf16 arm and an NVFP4 arm"))
    for method, name in starts.items():
        d = compare(runs, name, bf16, "pass1_before") if bf16 else None
        if d is not None:
            out.append(Claim(claim.format(method), "holds" if d["mean"] >= -0.01 else "does not hold",
                             diff_text(d, name, bf16, "pass@1 before")))

    # Table 1: NVFP4 + LoRA (+ AQN) at least as good as 16-bit LoRA after RL, and better than QLoRA
    for best in best_arms or [None]:
        for other, label in ((bf16, "16-bit LoRA"), (nf4, "NF4 QLoRA")):
            name = f"NVFP4 + AQN (best method) after RL >= {label} (held-out pass@1, paper Table 1)"
            name += f": {best}" if len(best_arms) > 1 else ""
            d = compare(runs, best, other, "pass1_after") if best and other else None
            out.append(Claim(name, _at_least(d), "needs both arms" if d is None
                             else diff_text(d, best, other, "pass@1 after")))
            d = compare(runs, best, other, "pass1_after_strict") if best and other else None
            if d is not None:  # the answer in the requested format only (runs scored before it lack it)
                out.append(Claim(name.replace("held-out pass@1", "held-out strict pass@1"), _at_least(d),
                                 diff_text(d, best, other, "strict pass@1 after")))
            # the same adapters served on the 16-bit model (--eval-16bit-base): what was learned, without the
            # 4-bit base's cost at inference
            for key, what in (("pass1_after_16bit", "pass@1 after, 16-bit base"),
                              ("pass1_after_16bit_strict", "strict pass@1 after, 16-bit base")):
                d = compare(runs, best, other, key) if best and other else None
                if d is not None:
                    where = "adapter on the 16-bit base after RL" + (", strict" if key.endswith("_strict") else "")
                    out.append(Claim(name.replace("after RL", where), _at_least(d), diff_text(d, best, other, what)))

    # AQN: more entropy (exploration), faster reward growth, a better final score, per format and method
    for name, arm in arms.items():
        if not arm.aqn or arm.decay != DEFAULT_DECAY:
            continue
        twin = _without_aqn(runs, name)
        if twin is None:
            continue
        ent = compare(runs, name, twin, "entropy_mean")
        growth = compare(runs, name, twin, "reward_growth")
        after = compare(runs, name, twin, "pass1_after")
        for what, d, text in (("raises the policy's entropy (mean over steps)", ent, "entropy"),
                              ("speeds reward growth (last 20% minus first 20% of steps)", growth, "reward growth"),
                              ("improves held-out pass@1 after RL", after, "pass@1 after")):
            verdict = "not measured" if d is None else (
                "holds" if d["mean"] > 0 and (d["se"] is None or d["mean"] > 2 * d["se"])
                else "within noise" if d["se"] is not None and abs(d["mean"]) <= 2 * d["se"]
                else "does not hold")
            evidence = "needs both arms" if d is None else diff_text(d, name, twin, text)
            if d is not None and text == "reward growth":
                evidence += _growth_ends(runs, name, twin)
            out.append(Claim(f"AQN {what}: {name} vs {twin}", verdict, evidence))

    # the decay schedule: the paper's exponential decay at least as good as the others
    decays = [n for n, a in arms.items() if a.aqn and a.decay != DEFAULT_DECAY]
    if not decays:
        out.append(Claim("the exponential AQN decay beats linear / cosine / logarithmic", "not measured",
                         "no arm with another decay (e.g. nvfp4+aqn:linear)"))
    for name in decays:
        arm = parse_arm(name)
        # the twin differs in the decay alone: same format, method, lr and noise level
        ref = next((n for n, a in arms.items() if a.aqn and a.decay == DEFAULT_DECAY
                    and (a.format, a.method, a.lr, a.sigma) == (arm.format, arm.method, arm.lr, arm.sigma)), None)
        d = compare(runs, ref, name, "pass1_after") if ref else None
        claim = f"the exponential AQN decay at least as good as {arm.decay}"
        if sum(arms[n].decay == arm.decay for n in decays) > 1:
            claim += f": {name}"
        out.append(Claim(claim, _at_least(d),
                         "needs the exponential twin" if d is None else diff_text(d, ref, name, "pass@1 after")))
    return out


def claims_markdown(items: list[Claim]) -> str:
    """One bullet per claim: **verdict**: claim -- evidence."""
    return "\n".join(f"- **{c.verdict}**: {c.name}. {c.evidence}." for c in items)
