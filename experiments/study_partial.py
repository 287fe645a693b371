"""An unfinished study's curves: per job the per-step metrics its trainer wrote before it was stopped
(`metrics.jsonl`) and its held-out "before" score (`job_state.json`), as one table (training reward and entropy
averaged over a window of steps, per seed and as the mean over seeds) and the study's reward / entropy plots.
For studies whose jobs were killed before result.json (a deadline, a lost machine): OUT is the study's --out.

    python experiments/study_partial.py OUT --first 1-5 --last 36-40
"""

import argparse
import json
from pathlib import Path


def window_mean(metrics: list[dict], key: str, steps: tuple[int, int]) -> float | None:
    """Mean of `key` over the steps lo..hi (1-based, inclusive) that the job reached; None if it reached none."""
    values = [m[key] for m in metrics if steps[0] <= m["step"] <= steps[1] and m.get(key) is not None]
    return sum(values) / len(values) if values else None


def parse_window(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def main(argv=None) -> int:
    from qerl.study import aggregate, plot_study

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the study's --out directory (one sub-directory per job)")
    ap.add_argument("--first", default="1-5", help="first window of steps, e.g. 1-5")
    ap.add_argument("--last", default="36-40", help="last window of steps, e.g. 36-40")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    first, last = parse_window(args.first), parse_window(args.last)
    runs = []
    for job in sorted(p for p in Path(args.out).iterdir() if (p / "job_state.json").is_file()):
        state = json.loads((job / "job_state.json").read_text())
        metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines() if line.strip()]
        runs.append({"arm": state["settings"]["arm"], "seed": state["settings"]["seed"], "metrics": metrics,
                     "pass1_before": state.get("pass1_before"), "pass1_after": None})
    if not runs:
        print(f"no job directory with job_state.json under {args.out}")
        return 1
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    print(f"| arm | seeds | steps reached | held-out pass@1 before | reward {args.first} per seed | "
          f"reward {args.last} per seed | mean reward {args.last} | entropy {args.first} -> {args.last} (mean) |")
    print("|---|---|---|---:|---|---|---:|---|")

    def fmt(v):
        return "-" if v is None else f"{v:.3f}"

    def mean(vs):
        vs = [v for v in vs if v is not None]
        return sum(vs) / len(vs) if vs else None

    for arm in arms:
        rs = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        r_first = [window_mean(r["metrics"], "reward", first) for r in rs]
        r_last = [window_mean(r["metrics"], "reward", last) for r in rs]
        e_first = mean([window_mean(r["metrics"], "entropy", first) for r in rs])
        e_last = mean([window_mean(r["metrics"], "entropy", last) for r in rs])
        print(f"| {arm} | {','.join(str(r['seed']) for r in rs)} | "
              f"{'/'.join(str(len(r['metrics'])) for r in rs)} | {fmt(mean([r['pass1_before'] for r in rs]))} | "
              f"{' / '.join(fmt(v) for v in r_first)} | {' / '.join(fmt(v) for v in r_last)} | "
              f"{fmt(mean(r_last))} | {fmt(e_first)} -> {fmt(e_last)} |")
    if not args.no_plots:
        agg = aggregate(runs, arms)
        for path in plot_study(runs, agg, Path(args.out)):
            if path.name == "study_pass1.png":  # no "after" score: the before/after bars would be half empty
                path.unlink()
            else:
                print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
