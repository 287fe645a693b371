"""Is a 4-bit arm's after-RL gap in the adapter it learned or in the base that carries it? Each trained adapter
scored on its own base and on the other one, from `qerl eval --out` files.

    python experiments/cross_base_eval.py DIR [--tag _t0.6n4] [--reference bf16]
    python experiments/cross_base_eval.py DIR --compact OUT_DIR   # keep per-problem rewards only (for the repo)

DIR holds one JSONL per (adapter, base), named `{arm}_s{seed}_on_{base}{tag}.jsonl`, as written by
`qerl eval MODEL --adapter RUN/adapter --dataset gsm8k-offline:heldout --out FILE [--format nvfp4 --keep-bf16
last:2]`: one line per problem with its `rewards` (one per sample). The same problems in the same order in every
file (checked through `qid`, a hash of the question, where present).

Printed: pass@1 per arm and base (mean over seeds, and each seed); the base effect per arm (own adapter, 16-bit
base minus 4-bit base); the adapter effect per base (each arm minus the reference arm on the same base). A
difference carries the larger of two standard errors: of its per-seed values (paired by seed) and of the
problems (each seed's per-problem differences: every evaluation scores the same problems); "within noise" is
inside two of them.
"""

import argparse
import hashlib
import json
import math
import re
import statistics
import sys
from pathlib import Path

NAME = re.compile(r"^(?P<arm>.+)_s(?P<seed>\d+)_on_(?P<base>[a-z0-9]+)(?P<tag>.*)\.jsonl$")


def problem_scores(path: Path) -> tuple[list[float], list[str | None]]:
    """([per-problem mean reward], [qid or None]) of one eval file."""
    scores, qids = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        rewards = row["rewards"]
        if not rewards:
            raise SystemExit(f"{path}: a problem without rewards")
        scores.append(sum(rewards) / len(rewards))
        qids.append(row.get("qid") or (_qid(row["question"]) if "question" in row else None))
    if not scores:
        raise SystemExit(f"{path}: no problems")
    return scores, qids


def _qid(question: str) -> str:
    return hashlib.sha1(question.encode()).hexdigest()[:10]


def load(directory: Path, tag: str) -> dict[tuple[str, int, str], list[float]]:
    """{(arm, seed, base): per-problem scores} of the files with this tag; every file the same problems."""
    evals, order, first = {}, None, None
    for path in sorted(directory.glob("*.jsonl")):
        m = NAME.match(path.name)
        if not m or m["tag"] != tag:
            continue
        scores, qids = problem_scores(path)
        if order is None:
            order, first = qids, path
        elif len(qids) != len(order) or any(a and b and a != b for a, b in zip(qids, order)):
            raise SystemExit(f"{path.name} and {first.name} hold different problems: not comparable")
        evals[m["arm"], int(m["seed"]), m["base"]] = scores
    if not evals:
        raise SystemExit(f"{directory}: no `ARM_sSEED_on_BASE{tag}.jsonl` files")
    return evals


def se_problems(a: list[float], b: list[float]) -> float:
    """Standard error over problems of mean(a) - mean(b), paired by problem (both scored on the same ones)."""
    d = [x - y for x, y in zip(a, b)]
    return statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0


def difference(pairs: list[tuple[list[float], list[float]]]) -> dict:
    """Mean over seeds of mean(a) - mean(b) (one pair of per-problem score lists per seed), with the larger of the
    seed SE and the problem SE."""
    d = [statistics.fmean(a) - statistics.fmean(b) for a, b in pairs]
    se_seed = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    se_prob = math.sqrt(sum(se_problems(a, b) ** 2 for a, b in pairs)) / len(pairs)
    se = max(se_seed, se_prob)
    return {"diff": statistics.fmean(d), "se": se, "se_seed": se_seed, "se_problems": se_prob, "n": len(d)}


def verdict(d: dict) -> str:
    return "within noise" if abs(d["diff"]) < 2 * d["se"] else ("higher" if d["diff"] > 0 else "lower")


def report(evals: dict, reference: str) -> str:
    arms = list(dict.fromkeys(arm for arm, _, _ in sorted(evals, key=lambda k: (k[0] != reference, k[0]))))
    bases = sorted({b for _, _, b in evals}, key=lambda b: (b != "bf16", b))
    n_problems = len(next(iter(evals.values())))
    lines = [f"{n_problems} problems per evaluation; pass@1 per adapter, mean over seeds (per seed)", "",
             "| adapter trained as | " + " | ".join(f"on the {b} base" for b in bases) + " |",
             "|---|" + "---:|" * len(bases)]
    for arm in arms:
        cells = []
        for base in bases:
            seeds = sorted(s for a, s, b in evals if a == arm and b == base)
            if not seeds:
                cells.append("-")
                continue
            v = [statistics.fmean(evals[arm, s, base]) for s in seeds]
            cells.append(f"{statistics.fmean(v):.3f} ({' / '.join(f'{x:.3f}' for x in v)})")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")

    def row(what: str, d: dict) -> str:
        return (f"| {what} | {d['diff']:+.3f} ± {d['se']:.3f} | {d['se_seed']:.3f} | {d['se_problems']:.3f} | "
                f"{d['n']} | {verdict(d)} |")

    header = ["| difference | mean ± SE | SE over seeds | SE over problems | seeds | verdict |",
              "|---|---:|---:|---:|---:|---|"]
    lines += ["", "base effect (the same adapter on two bases):", *header]
    for arm in arms:
        for base in bases[1:]:
            seeds = sorted(s for a, s, b in evals if a == arm and b == bases[0] and (arm, s, base) in evals)
            if seeds:
                d = difference([(evals[arm, s, bases[0]], evals[arm, s, base]) for s in seeds])
                lines.append(row(f"{arm}: {bases[0]} base − {base} base", d))
    lines += ["", f"adapter effect (another arm's adapter against {reference}'s on one base, paired by seed):", *header]
    for base in bases:
        for arm in arms:
            if arm == reference:
                continue
            seeds = sorted(s for a, s, b in evals if a == arm and b == base and (reference, s, base) in evals)
            if seeds:
                d = difference([(evals[arm, s, base], evals[reference, s, base]) for s in seeds])
                lines.append(row(f"on {base}: {arm} − {reference}", d))
    return "\n".join(lines)


def compact(directory: Path, out: Path) -> int:
    """Each eval file without its completions: per problem the qid, rewards and lengths (what `report` reads)."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for path in sorted(directory.glob("*.jsonl")):
        if not NAME.match(path.name):
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        keep = [{"qid": r.get("qid") or _qid(r["question"]), "rewards": r["rewards"], "lengths": r.get("lengths")}
                for r in rows]
        (out / path.name).write_text("".join(json.dumps(r) + "\n" for r in keep))
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--tag", default="", help="the file-name tag after the base, e.g. _t0.6n4 (default: none)")
    ap.add_argument("--reference", default="bf16", help="the arm other adapters are compared with")
    ap.add_argument("--compact", type=Path, metavar="OUT_DIR",
                    help="write the files without completions to OUT_DIR instead of reporting")
    args = ap.parse_args(argv)
    if not args.directory.is_dir():
        ap.error(f"{args.directory}: not a directory")
    if args.compact:
        print(f"{compact(args.directory, args.compact)} files written to {args.compact}")
        return 0
    evals = load(args.directory, args.tag)
    if not any(arm == args.reference for arm, _, _ in evals):
        ap.error(f"--reference {args.reference}: no such arm among {sorted({a for a, _, _ in evals})}")
    print(report(evals, args.reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
