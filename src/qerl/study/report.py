"""Aggregate study runs over seeds (mean and sample std), print the Markdown table, draw the plots."""

import math
import statistics
from pathlib import Path

from .arms import DEFAULT_DECAY, parse_arm

# Quantities aggregated over seeds, with their table headers and decimals.
AGGREGATED = (("pass1_before", "pass@1 before", 3), ("pass1_after", "pass@1 after", 3),
              ("pass1_before_strict", "strict pass@1 before", 3), ("pass1_after_strict", "strict pass@1 after", 3),
              ("pass1_after_16bit", "pass@1 after, 16-bit base", 3),
              ("pass1_after_16bit_strict", "strict pass@1 after, 16-bit base", 3),
              ("reward_first", "reward first", 3), ("reward_last", "reward last", 3),
              ("entropy_first", "entropy first", 3), ("entropy_last", "entropy last", 3),
              ("seconds", "train s", 1), ("time_rollout", "rollout s/step", 2),
              ("time_update", "update s/step", 2), ("memory_gb", "peak GB", 2))


# Columns shown only when some arm has them (a study run with --eval-16bit-base; the strict scores, which
# results.json files written before they existed lack).
OPTIONAL = {"pass1_after_16bit", "pass1_after_16bit_strict", "pass1_before_strict", "pass1_after_strict"}


# aggregation --------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> dict:
    """{"mean", "std" (sample std; None for n < 2), "n"} of the values that are not None."""
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not xs:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None, "n": len(xs)}


def aggregate(runs: list[dict], arms: list[str] | None = None) -> dict:
    """{arm: {"n": runs, "seeds": [...], quantity: mean_std}} over the finished runs, arms in the given order
    (by default the order in which they first appear)."""
    order = arms or list(dict.fromkeys(r["arm"] for r in runs))
    out = {}
    for arm in order:
        rows = [r for r in runs if r["arm"] == arm]
        if not rows:
            continue
        out[arm] = {"n": len(rows), "seeds": [r["seed"] for r in rows],
                    **{key: mean_std([r.get(key) for r in rows]) for key, _, _ in AGGREGATED}}
    return out


def fmt_stat(stat: dict, digits: int) -> str:
    if stat["mean"] is None:
        return "-"
    std = "-" if stat["std"] is None else f"{stat['std']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {std}"


def markdown_table(agg: dict) -> str:
    """The aggregate as a Markdown table, mean ± sample std over seeds ('-' where n < 2); an OPTIONAL column
    only when some arm has a value in it."""
    shown = [(key, label, digits) for key, label, digits in AGGREGATED
             if key not in OPTIONAL or any(row[key]["n"] for row in agg.values())]
    head = ["arm", "n", *(label for _, label, _ in shown)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, row in agg.items():
        cells = [arm, str(row["n"]), *(fmt_stat(row[key], digits) for key, _, digits in shown)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(agg: dict, outcomes: list[dict], meta: dict) -> str:
    """Header (model, steps, seeds, device, date, command), the table, then every job that did not finish."""
    lines = [f"{meta['model']}, {meta['steps']} steps, seeds {','.join(map(str, meta['seeds']))}, "
             f"{meta['device']}, {meta['date']}, {meta['parallel']} job(s) at a time"
             + (" (times inflated by concurrency)" if meta["parallel"] > 1 else ""),
             "", f"`{meta['command']}`", "", markdown_table(agg) if agg else "(no finished run)"]
    unfinished = [o for o in outcomes if o["status"] not in ("done", "cached")]
    if unfinished:
        lines += ["", "Not finished:"]
        for o in unfinished:
            lines.append(f"- {o['job'].name}: {o['status']}: {o['error']}")
            if o["status"] == "failed" and o["log_tail"]:
                lines += ["  " + t for t in o["log_tail"].splitlines()[-8:]]
    return "\n".join(lines)


# plots --------------------------------------------------------------------------------------------


def _curves(runs: list[dict], key: str):
    """(steps, [n_runs x n_steps] values) over the steps every run has; None marks a non-finite value."""
    import numpy as np

    n = min(len(r["metrics"]) for r in runs)
    steps = [m["step"] for m in runs[0]["metrics"][:n]]
    values = np.array([[np.nan if m.get(key) is None else m[key] for m in r["metrics"][:n]] for r in runs], float)
    return steps, values


def _plot_curves(ax, runs: list[dict], arms: list[str], key: str, spell=lambda arm: arm) -> None:
    """Mean over seeds per arm, with the min-max band over seeds shaded; spell(arm) is its legend name."""
    import numpy as np

    for arm in arms:
        rows = [r for r in runs if r["arm"] == arm and r.get("metrics")]
        if not rows:
            continue
        steps, values = _curves(rows, key)
        line, = ax.plot(steps, np.nanmean(values, axis=0), label=f"{spell(arm)} (n={len(rows)})")
        if len(rows) > 1:
            ax.fill_between(steps, np.nanmin(values, axis=0), np.nanmax(values, axis=0), color=line.get_color(),
                            alpha=0.2, linewidth=0)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def ablation_arms(arms: list[str]) -> list[str]:
    """The arms of the AQN decay ablation: for every format with >= 2 AQN decays, its AQN arms plus its plain
    arm as the no-noise reference. [] when no format has two decays."""
    parsed = [parse_arm(a) for a in arms]
    bases = [f for f in dict.fromkeys((a.format, a.method) for a in parsed)
             if len({a.decay for a in parsed if (a.format, a.method) == f and a.aqn}) >= 2]
    return [a.name for a in parsed if (a.format, a.method) in bases]


def _plot_pass1(agg: dict, arms: list[str], out: Path) -> Path:
    """Held-out pass@1 before / after per arm, bars with the std over seeds as error bars."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(arms)), 4.5))
    x, width = np.arange(len(arms)), 0.38
    for i, (key, label) in enumerate((("pass1_before", "before"), ("pass1_after", "after"))):
        means = [agg[a][key]["mean"] or 0.0 for a in arms]
        stds = [agg[a][key]["std"] or 0.0 for a in arms]
        ax.bar(x + (i - 0.5) * width, means, width, yerr=stds, capsize=3, label=label)
    ax.set_xticks(x, [f"{a.replace(':', chr(10) + ':')}\n(n={agg[a]['n']})" for a in arms], fontsize=8)
    ax.set(ylabel="held-out pass@1", title="held-out pass@1 before / after RL (error bars: std over seeds)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / "study_pass1.png")


def plot_study(runs: list[dict], agg: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, written = list(agg), []
    ablation = ablation_arms(arms)
    # the other decays have their own figure; eight overlapping bands in one would hide the main comparison
    main_arms = [a for a in arms if a not in ablation or parse_arm(a).decay == DEFAULT_DECAY]
    band = " (mean over seeds, band: min-max)"
    for key, label in (("reward", "train reward"), ("entropy", "entropy (nats/token)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        _plot_curves(ax, runs, main_arms, key)
        ax.set(xlabel="step", ylabel=label, title=label + band)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / f"study_{key}.png"))

    if any(agg[a][key]["mean"] is not None for a in arms for key in ("pass1_before", "pass1_after")):
        written.append(_plot_pass1(agg, arms, out))

    if ablation:
        fig, ax = plt.subplots(figsize=(7, 4))
        decay = {a: parse_arm(a) for a in ablation}  # name the default decay too: it is one of those compared
        _plot_curves(ax, runs, ablation, "reward",
                     lambda a: f"{decay[a].format}+aqn:{decay[a].decay}" if decay[a].aqn else f"{a} (no AQN)")
        ax.set(xlabel="step", ylabel="train reward", title="AQN decay ablation" + band)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "study_ablation_reward.png"))
    return written
