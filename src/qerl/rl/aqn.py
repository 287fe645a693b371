"""The AQN noise schedule: sigma per training stage (Adaptive Quantization Noise, QeRL paper arXiv 2510.11696).

Training is split into K equal stages. Stage 0 has sigma = 0 (quantization noise only); stages 1..K-1
decay from sigma_start to sigma_end, the last stage exactly sigma_end. With u = (k-1)/(K-2) in [0, 1]:

  exponential (default)  sigma_start * (sigma_end / sigma_start) ** u      (linear in log sigma)
  linear                 sigma_start + (sigma_end - sigma_start) * u
  cosine                 sigma_end + (sigma_start - sigma_end) * (1 + cos(pi u)) / 2
  logarithmic            sigma_start + (sigma_end - sigma_start) * ln(1 + 9u) / ln(10)   (fast early decay)

With K = 2 there is one noisy stage, which is the last one, so it gets sigma_end.
"""

import math
from dataclasses import dataclass

from ..choices import DECAYS  # the values of `decay` (and of the config's aqn.decay)

# sigma_start / median |norm weight| below which AQN barely changes sampling: measured on CPU (docs/results.md,
# "AQN's direct effect"), 0.006 (Qwen2.5-Coder-1.5B at 1e-2) moved the policy by KL 0.0004 per token, while 0.037
# (SmolLM2-135M at 1e-2) and 0.063 (the 1.5B at 0.1) moved it by KL 0.04
WEAK_NOISE_RATIO = 0.015


def weak_noise_note(sigma_start: float, median_abs_weight: float) -> str | None:
    """A warning when sigma_start is too small against the model's norm weights to perturb it, else None."""
    if median_abs_weight <= 0 or sigma_start / median_abs_weight >= WEAK_NOISE_RATIO:
        return None
    # 3%: on the 1.5B, 3% (sigma 0.05) moved the policy without the entropy blow-ups 6% (0.1) caused in 4 of 9 runs
    suggested = 0.03 * median_abs_weight
    return (f"AQN: sigma_start {sigma_start:g} is {100 * sigma_start / median_abs_weight:.1f}% of this model's median "
            f"norm weight ({median_abs_weight:.2f}), too little to change its sampling (measured at 1.5B: 0.6% gave "
            f"a KL of 0.0004 per token); about {suggested:.2g} (3%) moves a policy by KL ~0.01; 6% made single "
            "rollout batches blow up (docs/results.md, \"AQN's direct effect\" and the 1.5B study)")


def stage_sigma(stage: int, num_stages: int = 10, sigma_start: float = 1e-2, sigma_end: float = 5e-4,
                decay: str = "exponential") -> float:
    """sigma of stage `stage` (0-based) out of `num_stages`."""
    if decay not in DECAYS:
        raise ValueError(f"unknown AQN decay {decay!r}; choose one of {DECAYS}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")
    if sigma_start < 0 or sigma_end < 0:
        raise ValueError("AQN sigmas must be >= 0")
    if stage == 0:
        return 0.0
    u = 1.0 if num_stages == 2 else (stage - 1) / (num_stages - 2)
    if decay == "exponential":
        if sigma_start == 0 or sigma_end == 0:
            raise ValueError("exponential AQN decay needs sigma_start, sigma_end > 0")
        return sigma_start * (sigma_end / sigma_start) ** u
    if decay == "linear":
        return sigma_start + (sigma_end - sigma_start) * u
    if decay == "cosine":
        return sigma_end + (sigma_start - sigma_end) * (1 + math.cos(math.pi * u)) / 2
    return sigma_start + (sigma_end - sigma_start) * math.log1p(9 * u) / math.log(10)


@dataclass(frozen=True)
class AQNSchedule:
    """sigma as a function of the training step: `schedule.sigma(step, total_steps)`.

    enabled False gives 0 everywhere (the no-AQN ablation).
    """

    num_stages: int = 10
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    decay: str = "exponential"
    enabled: bool = True

    def __post_init__(self):
        stage_sigma(0, self.num_stages, self.sigma_start, self.sigma_end, self.decay)  # validates

    def stage(self, step: int, total_steps: int) -> int:
        """Which of the K equal stages step (0-based) of total_steps falls in."""
        if total_steps < 1 or not 0 <= step < total_steps:
            raise ValueError(f"step {step} outside 0..{total_steps - 1}")
        return min(step * self.num_stages // total_steps, self.num_stages - 1)

    def sigma(self, step: int, total_steps: int) -> float:
        if not self.enabled:
            return 0.0
        return stage_sigma(self.stage(step, total_steps), self.num_stages, self.sigma_start, self.sigma_end,
                           self.decay)


@dataclass
class EntropyController:
    """Beyond the paper: scale the scheduled sigma to hold a target policy entropy.

    After each step, multiplier <- clip(multiplier * exp(gain * (target - entropy) / target), lo, hi): too
    little entropy (collapsing exploration) raises the noise, too much lowers it. sigma used =
    schedule sigma x multiplier, so stage 0 (sigma 0) stays noise-free.
    """

    target: float
    gain: float = 0.5
    lo: float = 0.1
    hi: float = 10.0
    multiplier: float = 1.0

    def __post_init__(self):
        if self.target <= 0 or self.gain <= 0 or not 0 < self.lo <= 1 <= self.hi:
            raise ValueError("EntropyController needs target > 0, gain > 0 and lo <= 1 <= hi")

    def update(self, entropy: float) -> float:
        """Feed the step's mean token entropy; returns the new multiplier."""
        if math.isfinite(entropy):
            step = math.exp(self.gain * (self.target - entropy) / self.target)
            self.multiplier = min(self.hi, max(self.lo, self.multiplier * step))
        return self.multiplier
