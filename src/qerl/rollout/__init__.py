"""Rollouts: batched sampling from the quantized LoRA policy (static KV cache, CUDA graphs, AQN)."""

from .engine import Rollout, RolloutEngine
from .sampling import SamplingParams

__all__ = ["Rollout", "RolloutEngine", "SamplingParams"]
