"""Training reward and entropy per arm over a window of steps, from finished studies and from unfinished ones.

`python experiments/study_window.py --steps 31-45 RUN/results.json ... PARTIAL_DIR ...`: each argument is a study's
results.json (its runs' per-step metrics) or a study output directory whose job folders hold `metrics.jsonl` and
`job_state.json` (a study that stopped before its end, e.g. when its machine went away: no held-out score, no
result.json). Prints, per source and arm, the mean over the window of each seed's training reward and entropy,
and their mean over seeds. A run that did not reach the window's last step is left out and named. Training
reward is measured on the rollouts (for AQN arms with the noise on); it never touches the held-out set.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


def runs_of(source: Path) -> list[dict]:
    """[{arm, seed, metrics: [per-step dict]}] from a results.json or a study directory's job folders."""
    if source.is_file():
        return [{"arm": r["arm"], "seed": r["seed"], "metrics": r.get("metrics", [])}
                for r in json.loads(source.read_text())["runs"]]
    runs = []
    for state in sorted(source.glob("*/job_state.json")):
        settings = json.loads(state.read_text()).get("settings", {})
        metrics_file = state.parent / "metrics.jsonl"
        if "arm" not in settings or not metrics_file.is_file():
            continue
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        runs.append({"arm": settings["arm"], "seed": settings["seed"], "metrics": metrics})
    if not runs:
        raise SystemExit(f"{source}: neither a results.json nor a study directory with job folders")
    return runs


def window_means(run: dict, first: int, last: int) -> dict | None:
    """{reward, entropy}: means over steps first..last, or None when the run stopped before step `last`."""
    steps = [m for m in run["metrics"] if first <= m["step"] <= last]
    if not steps or max(m["step"] for m in steps) < last:
        return None
    return {key: statistics.fmean(m[key] for m in steps) for key in ("reward", "entropy")}


def window_markdown(sources: list[tuple[str, list[dict]]], first: int, last: int) -> str:
    lines = [f"| source | arm | seeds | reward, steps {first}-{last}, per seed | mean | entropy, mean | left out "
             "(stopped earlier) |", "|---|---|---|---|---:|---:|---|"]
    for name, runs in sources:
        for arm in dict.fromkeys(r["arm"] for r in runs):
            rs = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
            means = [(r["seed"], window_means(r, first, last)) for r in rs]
            kept = [(seed, w) for seed, w in means if w is not None]
            short = [str(seed) for seed, w in means if w is None]
            if not kept:
                lines.append(f"| {name} | {arm} | - | - | - | - | {', '.join(short)} |")
                continue
            lines.append(f"| {name} | {arm} | {', '.join(str(s) for s, _ in kept)} | "
                         f"{' / '.join(format(w['reward'], '.3f') for _, w in kept)} | "
                         f"{statistics.fmean(w['reward'] for _, w in kept):.3f} | "
                         f"{statistics.fmean(w['entropy'] for _, w in kept):.3f} | {', '.join(short) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help="results.json files and/or study output directories")
    ap.add_argument("--steps", required=True, help="the window, FIRST-LAST (1-based, inclusive), e.g. 31-45")
    args = ap.parse_args(argv)
    try:
        first, last = (int(v) for v in args.steps.split("-"))
    except ValueError:
        ap.error(f"--steps {args.steps!r}: expected FIRST-LAST, e.g. 31-45")
    if not 1 <= first <= last:
        ap.error(f"--steps {args.steps!r}: expected 1 <= FIRST <= LAST")
    sources = [(str(Path(s)), runs_of(Path(s))) for s in args.sources]
    print(window_markdown(sources, first, last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
