"""Kept for benchmarks/peers/side_by_side.py until it imports `qerl.study` (run_jobs, write_json_atomic)."""

from ..study.jobs import run_jobs, write_json_atomic

__all__ = ["run_jobs", "write_json_atomic"]
