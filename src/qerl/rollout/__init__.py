"""Rollouts: batched sampling from the quantized LoRA policy (static KV cache, CUDA graphs, AQN)."""

from .engine import RolloutEngine
from .result import Rollout
from .sampling import SamplingParams

__all__ = ["Rollout", "RolloutEngine", "SamplingParams"]
