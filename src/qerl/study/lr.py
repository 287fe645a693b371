"""A learning-rate sweep read from a study's finished runs: arms that differ only in their @LR form one group
(e.g. nvfp4+aqn@2e-5, nvfp4+aqn@5e-5, nvfp4+aqn@1e-4), and each group's learning rate is picked by the mean
training reward over the last 20% of steps, averaged over seeds.

Why training reward: every step draws prompts the run has not trained on, so the late reward estimates how well
the policy samples on new problems without touching the held-out set, which the study's "after" score must
stay independent of (pick with `--eval-limit 0`, then run the study at the picked rates). For AQN arms that
reward is measured on the noisy rollouts.

    lr_groups(runs) -> {base arm: {lr: [runs]}}; best_lrs(runs) -> {base arm: lr}; lr_sweep_markdown(runs) -> str
"""

import dataclasses
import statistics

from .arms import parse_arm
from .claims import DERIVED


def _base(arm: str) -> str:
    """The arm's name without its learning rate (nvfp4+aqn@1e-4 -> nvfp4+aqn)."""
    return dataclasses.replace(parse_arm(arm), lr=None).name


def lr_groups(runs: list[dict]) -> dict[str, dict[float, list[dict]]]:
    """{base arm: {lr: runs}} for the arms with an @LR; groups in the order their first run appears, rates
    ascending."""
    groups: dict[str, dict[float, list[dict]]] = {}
    for run in runs:
        lr = parse_arm(run["arm"]).lr
        if lr is not None:
            groups.setdefault(_base(run["arm"]), {}).setdefault(lr, []).append(run)
    return {base: dict(sorted(by_lr.items())) for base, by_lr in groups.items()}


def _mean(runs: list[dict], key: str) -> float | None:
    get = DERIVED.get(key, lambda r: r.get(key))
    xs = [float(v) for v in map(get, runs) if v is not None]
    return statistics.fmean(xs) if xs else None


def best_lrs(runs: list[dict]) -> dict[str, float]:
    """{base arm: the rate with the highest mean late training reward} (ties: the smaller rate)."""
    out = {}
    for base, by_lr in lr_groups(runs).items():
        scored = [(score, -lr, lr) for lr, rs in by_lr.items() if (score := _mean(rs, "reward_last")) is not None]
        if scored:
            out[base] = max(scored)[2]
    return out


def lr_sweep_markdown(runs: list[dict]) -> str:
    """One row per (group, rate): seeds, late training reward (mean ± sample std over seeds), reward growth,
    late entropy, held-out pass@1 after where it was measured; the picked rate in bold."""
    best = best_lrs(runs)
    lines = ["| arm | lr | n | train reward, last 20% of steps | reward growth | entropy, last 20% | pass@1 after |",
             "|---|---:|---:|---|---:|---:|---:|"]

    def cell(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    for base, by_lr in lr_groups(runs).items():
        for lr, rs in by_lr.items():
            late = [r["reward_last"] for r in rs if r.get("reward_last") is not None]
            spread = f" ± {statistics.stdev(late):.3f}" if len(late) > 1 else ""
            lr_text = f"**{lr:g}**" if best.get(base) == lr else f"{lr:g}"
            lines.append(f"| {base} | {lr_text} | {len(rs)} | {cell(_mean(rs, 'reward_last'))}{spread} | "
                         f"{cell(_mean(rs, 'reward_growth'))} | {cell(_mean(rs, 'entropy_last'))} | "
                         f"{cell(_mean(rs, 'pass1_after'))} |")
    if any(len(rs) < 2 for by_lr in lr_groups(runs).values() for rs in by_lr.values()):
        lines.append("\nOne seed at some rate: nothing shows how far the late reward moves between seeds. At 1.5B a "
                     "30-step, one-seed sweep separated rates by 0.02 and picked rates that ended below the "
                     "runner-up after 100 steps on 3 seeds (docs/results.md, \"A real 1.5B model\"); confirm a "
                     "pick over several seeds, close to the study's length.")
    return "\n".join(lines)
