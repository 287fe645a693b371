"""Word overlap of the held-out GSM8K problems with the offline training sources (a contamination check).

    python benchmarks/data_overlap.py [--heldout gsm8k-offline:heldout] [--gym-size 2000] [--symbolic-size 300]

For each training source: "held-out > 0.5" counts the held-out questions that share more than half of their
word set (lowercased alphanumeric tokens) with one training question, with the max and mean of that share
(`qerl.data.overlap.max_overlap`); "train > 0.5" counts the other way round, training questions that share
more than half of their words with one held-out question (a generated question made from a held-out one).
The sources: the training part of the offline split, the full GSM8K test set (every held-out question is in
it: the reference for contamination), reasoning-gym gsm_symbolic (generated from GSM8K test problems), and
the reasoning-gym tasks qerl's defaults use (`GYM_DEFAULTS`). "held-out > 0.8" is the stricter count:
independent GSM8K problems share more than half their words often (common words), more than 0.8 rarely. Then,
for gsm_symbolic, which test problem each of its templates was made from and how many of those are held out.
Generation is seeded: the same arguments print the same table. --examples N prints the N closest pairs.
"""

import argparse
import platform
import shlex
import sys
import time

from qerl.data import load_problems
from qerl.data.datasets import GSM8K_HELDOUT, GSM8K_OFFLINE, GSM8K_TRAIN_OFFLINE, GYM_DEFAULTS
from qerl.data.overlap import THRESHOLD, format_summary, max_overlap


def sources(gym_size: int, symbolic_size: int) -> list[tuple[str, str]]:
    """(label, load_problems source) of every training source compared."""
    gym = [(f"reasoning-gym:{t}", f"reasoning-gym:{t}?size={gym_size}") for t in GYM_DEFAULTS]
    return [(GSM8K_TRAIN_OFFLINE, GSM8K_TRAIN_OFFLINE), (f"{GSM8K_OFFLINE} (full test set)", GSM8K_OFFLINE),
            ("reasoning-gym:gsm_symbolic", f"reasoning-gym:gsm_symbolic?size={symbolic_size}"), *gym]


STRICT = 0.8  # a second, stricter threshold: independent GSM8K problems rarely share this much


def measure(heldout: list[str], train: list[str]) -> dict:
    forward = max_overlap(heldout, train)
    s = forward.summary()
    backward = max_overlap(train, heldout)
    return {"n": len(train), **{k: s[k] for k in ("above", "max", "mean")},
            "strict": int((forward.scores > STRICT).sum()), "train_above": backward.above}


def _count(k: int, n: int) -> str:
    return f"{k} ({100 * k / n:.1f}%)" if n else "0"


def table(rows: list[tuple[str, dict]], n_heldout: int) -> str:
    head = (f"| training source | questions | held-out > {THRESHOLD:g} (of {n_heldout}) | held-out > {STRICT:g} | "
            f"max | mean | train > {THRESHOLD:g} |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for label, m in rows:
        lines.append(f"| {label} | {m['n']} | {_count(m['above'], n_heldout)} | {_count(m['strict'], n_heldout)} | "
                     f"{m['max']:.2f} | {m['mean']:.2f} | {_count(m['train_above'], m['n'])} |")
    return "\n".join(lines)


def symbolic_templates(test: list[str], samples: int = 20) -> dict[int, tuple[int, int, float]] | None:
    """Which GSM8K test problem each gsm_symbolic template was made from: template -> (test index its samples
    match best most often, how many of `samples` match it, mean share). Reads reasoning-gym's generator table
    (not public API): None when it is not there."""
    from collections import Counter
    from random import Random

    try:
        from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import (GSMSymbolicDataset,
                                                                        GSMSymbolicDatasetConfig, tasks_ok)
        generators = GSMSymbolicDataset(GSMSymbolicDatasetConfig(size=1, seed=0)).generators
    except (ImportError, AttributeError):
        return None
    found = {}
    for g in sorted(tasks_ok):
        qs = [generators[g](Random(s), 1.0)["question"] for s in range(samples)]
        o = max_overlap(qs, test)
        index, hits = Counter(o.best.tolist()).most_common(1)[0]
        found[g] = (index, hits, float(o.scores.mean()))
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heldout", default=GSM8K_HELDOUT, help="the evaluation source (its test split)")
    ap.add_argument("--gym-size", type=int, default=2000, help="problems generated per reasoning-gym default task")
    ap.add_argument("--symbolic-size", type=int, default=300, help="gsm_symbolic problems generated")
    ap.add_argument("--seed", type=int, default=0, help="reasoning-gym generation seed (train split)")
    ap.add_argument("--examples", type=int, default=0, help="print the N closest pairs of each source")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    heldout = [r["question"] for r in load_problems(args.heldout, split="test")]
    rows = []
    for label, source in sources(args.gym_size, args.symbolic_size):
        split = "test" if source == GSM8K_OFFLINE else "train"  # the full set as what it is: no training warning
        train = [r["question"] for r in load_problems(source, split=split, seed=args.seed)]
        rows.append((label, measure(heldout, train)))
        if args.examples:
            print(f"{label}:\n{format_summary(max_overlap(heldout, train), heldout, train, top=args.examples)}\n")
    print(f"held-out: {args.heldout} ({len(heldout)} questions); {platform.machine()} CPU, "
          f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.1f} s")
    print(f"command: {shlex.join(['python', 'benchmarks/data_overlap.py', *(sys.argv[1:] if argv is None else argv)])}")
    print(table(rows, len(heldout)))
    if args.heldout == GSM8K_HELDOUT:
        test = [r["question"] for r in load_problems(GSM8K_OFFLINE, split="test")]
        found = symbolic_templates(test)
        if found:
            held = sorted(i for i, _, _ in found.values() if i < len(heldout))
            sure = sum(h == 20 for _, h, _ in found.values())
            print(f"\ngsm_symbolic: {len(found)} templates, each made from one GSM8K test problem (the best word "
                  f"match of 20 samples; all 20 agree for {sure}); {len(held)} of those problems are held out "
                  f"({', '.join(f'#{i}' for i in held)}), {len(found) - len(held)} in {GSM8K_TRAIN_OFFLINE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
