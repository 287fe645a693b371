"""Benchmarks run on a GPU (`qerl bench ...`); results are recorded in docs/benchmarks.md."""
