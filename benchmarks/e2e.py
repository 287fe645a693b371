"""End-to-end RL step benchmark (see `qerl.bench.step`, also `qerl bench step`): python benchmarks/e2e.py --help

Forced lengths (--completion N) or ragged ones drawn from a length profile (--lengths NAME|FILE); --modes new,old
times the continuous scheduler + packed update against the static scheduler + padded update side by side."""

from qerl.bench.step import main

if __name__ == "__main__":
    raise SystemExit(main())
