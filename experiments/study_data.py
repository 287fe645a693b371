"""Write the study's data as JSONL for a machine without reasoning-gym (the GPU machine has none).

    python experiments/study_data.py --task basic_arithmetic --out .gpu/data

writes, for task T (reasoning-gym task names, qerl's defaults for them in `qerl.data.datasets.GYM_DEFAULTS`):

  T_train.jsonl   --train-size problems of the train split (seed --seed), in order
  T_test.jsonl    the first --test-size problems of the test split whose question is not among the training
                  questions (held out: evaluating on a training question would measure memorisation)
  T_calib.jsonl   what calibration source "auto" gives `qerl train` on T_train (the reasoning-gym mixture
                  followed by the first training problems, `--samples` x `--max-tokens` worth of each), so
                  `model.calibration.source=T_calib.jsonl` reproduces it offline

and prints the counts. The same arguments write the same files (reasoning-gym is seeded).
"""

import argparse
import json
from pathlib import Path

from qerl.data import load_problems
from qerl.data.calibration import mixture_problems
from qerl.models.calibration import TOKENS_PER_PROBLEM


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps({"question": r["question"], "answer": str(r["answer"])}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--out", type=Path, default=Path(".gpu/data"))
    ap.add_argument("--train-size", type=int, default=2000)
    ap.add_argument("--test-size", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=128, help="model.calibration.samples")
    ap.add_argument("--max-tokens", type=int, default=256, help="model.calibration.max_tokens")
    args = ap.parse_args()

    train = load_problems(f"reasoning-gym:{args.task}", split="train", limit=args.train_size, seed=args.seed)
    seen = {r["question"] for r in train}
    test, drawn = [], args.test_size
    while len(test) < args.test_size:  # draw more of the test split until enough are disjoint from train
        drawn *= 2
        pool = load_problems(f"reasoning-gym:{args.task}", split="test", limit=drawn, seed=args.seed)
        test = [r for r in pool if r["question"] not in seen][:args.test_size]
        if drawn > 64 * args.test_size:
            raise SystemExit(f"{args.task}: only {len(test)} test problems differ from the training ones")
    n_calib = args.samples * args.max_tokens // TOKENS_PER_PROBLEM
    calib = mixture_problems(n_calib) + train[:n_calib]

    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test), ("calib", calib)):
        write_jsonl(args.out / f"{args.task}_{name}.jsonl", rows)
    print(f"{args.task}: {len(train)} train ({len(seen)} distinct questions), {len(test)} held-out test "
          f"(from {drawn} drawn), {len(calib)} calibration problems -> {args.out}")


if __name__ == "__main__":
    main()
