"""Kept for bench/rollout.py and benchmarks/peers/rollout_vllm.py until they import `qerl.data.length_profiles`."""

from ..data.length_profiles import NAMED, describe, draw, forced_label, resolve_lengths

__all__ = ["NAMED", "describe", "draw", "forced_label", "resolve_lengths"]
