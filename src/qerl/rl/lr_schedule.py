"""The learning-rate schedule of the LoRA optimizer: a factor of the base LR per step (torch's LambdaLR)."""

import math
from typing import Callable

from ..choices import SCHEDULES  # the values of `schedule` (and of the config's optim.schedule)


def lr_factor(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """step (0-based) -> factor of the base LR: (step + 1) / warmup_steps during the warmup, then 1
    (constant) or a half cosine from 1 down to 0 at `total_steps` (cosine)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown LR schedule {schedule!r}; choose one of {SCHEDULES}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor
