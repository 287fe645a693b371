"""Several studies made with the same settings (model, config, data, steps, held-out set, --set) read as one:
their runs pooled, then the study's table, claims, learning-rate table and plots written to OUT. Studies that
differ in any setting are refused, as are two runs of the same arm and seed. Arms without an @LR ran at the
config's optim.lr; the learning-rate table names that rate so those runs join their format's sweep.

    python experiments/study_merge.py OUT STUDY/results.json STUDY2/results.json [--arms a,b,...] [--compare A/B,...]

--compare adds, for each pair of arms, the differences the claims use (held-out pass@1 after, on the 16-bit base
too where the studies measured it, reward growth, entropy), seed by seed with the same standard error (unpaired,
from every seed of each, when the two arms share no seed), for pairs the claims do not name.
"""

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path


def merge(results: list[dict]) -> list[dict]:
    """The runs of every study, checked: one settings dict, no (arm, seed) twice, and the runs of one arm that
    recorded their resolved config (`config` in result.json) made with the same one (the same config path can
    hold another file by then)."""
    from qerl.study import config_diffs

    settings = results[0]["settings"]
    for i, r in enumerate(results[1:], 2):
        diffs = [k for k in set(settings) | set(r["settings"]) if settings.get(k) != r["settings"].get(k)]
        if diffs:
            raise SystemExit(f"study {i} differs from study 1 in {', '.join(sorted(diffs))}: not one experiment")
    runs, seen = [], set()
    for r in results:
        for run in r["runs"]:
            key = (run["arm"], run["seed"])
            if key in seen:
                raise SystemExit(f"{run['arm']} seed {run['seed']} is in two studies; keep one")
            seen.add(key)
            runs.append(run)
    first = {}
    for run in runs:
        if "config" in run:
            ref = first.setdefault(run["arm"], run)
            diffs = config_diffs(ref["config"], run["config"])
            if diffs:
                raise SystemExit(f"{run['arm']}: seed {ref['seed']} and seed {run['seed']} ran with other configs "
                                 f"({', '.join(diffs)}): not one arm")
    unchecked = sum("config" not in run for run in runs)
    if unchecked:
        print(f"note: {unchecked} of {len(runs)} runs did not record their resolved config; for those only the "
              "study settings (config path, --set, ...) were compared", file=sys.stderr)
    return runs


def with_base_lr(runs: list[dict], base_lr: float) -> list[dict]:
    """The runs with every arm spelled with its learning rate: an arm without @LR ran at the optim.lr its result
    recorded, or, for results that recorded no config, at base_lr (the config file's rate now)."""
    from qerl.study import parse_arm

    out = []
    for run in runs:
        arm = parse_arm(run["arm"])
        lr = arm.lr or run.get("config", {}).get("optim", {}).get("lr") or base_lr
        out.append({**run, "arm": dataclasses.replace(arm, lr=lr).name})
    return out


BLOWN_UP_ENTROPY = 1.0  # nats per token: ~4x any arm's first steps; the sigma-0.1 blow-ups reached 2.4-6.3


def step_diagnostics_markdown(runs: list[dict], arms: list[str]) -> str:
    """Per arm, from each run's per-step metrics (means over steps, then over seeds): the sampled reward of steps
    1-3 (the start under sampling, which greedy pass@1 before does not show), gradient norm, clip fraction, the
    rollout/training mismatch weight (TIS), the share of rows at the token limit; and the steps whose mean token
    entropy exceeded BLOWN_UP_ENTROPY (an AQN draw that broke a whole rollout batch)."""
    def mean_of(rs, key, steps=None):
        per_run = [statistics.fmean(vals) for r in rs
                   if (vals := [m[key] for m in r.get("metrics", []) if m.get(key) is not None
                                and (steps is None or m["step"] in steps)])]
        return f"{statistics.fmean(per_run):.3f}" if per_run else "-"

    lines = ["| arm | n | reward, steps 1-3 | grad norm | clip fraction | TIS weight | rows at the limit | runs with a "
             f"step above {BLOWN_UP_ENTROPY:g} nat | those steps: entropy, rows at the limit, reward |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        blown = [(r["seed"], m) for r in rs for m in r.get("metrics", [])
                 if (m.get("entropy") or 0.0) > BLOWN_UP_ENTROPY]
        where = "; ".join(f"seed {seed} step {m['step']}: {m['entropy']:.2f}, {m.get('truncated_fraction', 0):.2f}, "
                          f"{m.get('reward', float('nan')):.2f}" for seed, m in blown) or "-"
        lines.append(f"| {arm} | {len(rs)} | {mean_of(rs, 'reward', {1, 2, 3})} | {mean_of(rs, 'grad_norm')} | "
                     f"{mean_of(rs, 'clip_fraction')} | {mean_of(rs, 'tis_weight_mean')} | "
                     f"{mean_of(rs, 'truncated_fraction')} | {len({seed for seed, _ in blown})} of {len(rs)} | "
                     f"{where} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from qerl.study import (aggregate, best_lrs, claims, claims_markdown, compare, diff_text, lr_groups,
                            lr_sweep_markdown, markdown_table, plot_study, pooled_std, scoped_override)
    from qerl.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for the merged table, claims and plots")
    ap.add_argument("results", nargs="+", help="each study's results.json")
    ap.add_argument("--arms", default=None, help="arms of the table and plots, in this order (default: all); the "
                    "claims and the pooled seed spread always use every run")
    ap.add_argument("--compare", default="",
                    help="pairs of arms A/B, comma-separated: A minus B, paired by seed (unpaired when they share "
                         "none)")
    args = ap.parse_args(argv)
    pairs = [tuple(p.split("/")) for p in args.compare.split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--compare {args.compare!r}: expected pairs A/B, e.g. nvfp4+aqn/nvfp4")

    results = [json.loads(Path(p).read_text()) for p in args.results]
    every_run = merge(results)
    arms = args.arms.split(",") if args.arms else None
    runs = every_run
    if arms:
        missing = [a for a in arms if not any(r["arm"] == a for r in every_run)]
        if missing:
            raise SystemExit(f"--arms: no run of {', '.join(missing)}")
        runs = [r for r in every_run if r["arm"] in arms]
    settings = results[0]["settings"]
    base_lr = load_config(settings["config"], [plain for fmt, plain in map(scoped_override, settings["set"])
                                               if fmt is None]).optim.lr

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(runs, arms)
    lines = [f"{len(every_run)} runs from {len(results)} studies ({', '.join(args.results)}); settings: "
             f"{json.dumps(settings)}; arms without @LR ran at lr {base_lr:g}", "", markdown_table(agg), ""]
    for key, label in (("pass1_after", "pass@1 after"), ("reward_growth", "reward growth")):
        std, n_arms = pooled_std(every_run, key)
        if std is not None:
            lines.append(f"seed-to-seed std of {label}, pooled over {n_arms} arms: {std:.4f}")
    lines += ["", "per-step diagnostics:", step_diagnostics_markdown(runs, list(agg)),
              "", "the paper's claims:", claims_markdown(claims(every_run))]
    if pairs:
        lines += ["", "comparisons:"]
        for a, b in pairs:
            for key, what in (("pass1_after", "pass@1 after"), ("pass1_after_16bit", "pass@1 after, 16-bit base"),
                              ("reward_growth", "reward growth"), ("entropy_mean", "entropy")):
                d = compare(every_run, a, b, key)
                if d is None and key == "pass1_after_16bit":
                    continue  # measured only by studies run with --eval-16bit-base
                lines.append(f"- {diff_text(d, a, b, what)}" if d else f"- {what}: {a} or {b} has no run")
    swept = {base for base, by_lr in lr_groups(with_base_lr(every_run, base_lr)).items() if len(by_lr) > 1}
    spelled = [r for r in with_base_lr(every_run, base_lr) if r["arm"].split("@")[0] in swept]
    if spelled:
        picked = ", ".join(f"{base}@{lr:g}" for base, lr in best_lrs(spelled).items())
        lines += ["", "learning rates (100-step runs):", lr_sweep_markdown(spelled),
                  f"highest late training reward: {picked}"]
    text = "\n".join(lines)
    (out / "merged.md").write_text(text + "\n")
    for path in plot_study(runs, agg, out):
        print(f"plot: {path}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
