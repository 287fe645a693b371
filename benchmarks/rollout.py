"""Rollout throughput benchmark (see `qerl.bench.rollout`): python benchmarks/rollout.py --help"""

from qerl.bench.rollout import main

if __name__ == "__main__":
    raise SystemExit(main())
