"""End-to-end RL step benchmark (see `qerl.bench.step`, also `qerl bench step`): python benchmarks/e2e.py --help"""

from qerl.bench.step import main

if __name__ == "__main__":
    raise SystemExit(main())
