"""Rollout throughput benchmark (see `qerl.bench.rollout`): python benchmarks/rollout.py --help

Forced lengths (--new N) or ragged ones drawn from a length profile (--lengths NAME|FILE, --group G);
--schedulers continuous,static times both engine schedulers on the same draws."""

from qerl.bench.rollout import main

if __name__ == "__main__":
    raise SystemExit(main())
