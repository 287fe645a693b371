"""Clipped policy-gradient losses: GRPO (arXiv 2402.03300), DAPO (arXiv 2503.14476), Dr. GRPO (arXiv 2503.20783),
as the QeRL paper (arXiv 2510.11696) trains with them; docs/training.md, "One step".

All inputs are per completion token, [B, T] with a bool mask (False = padding or filtered). The loss of a
whole batch is a sum of per-token terms divided by a normaliser that depends on the algorithm and is
computed ONCE for the full batch (`loss_normalizer`), so micro-batching and gradient accumulation give the
same gradient as one big batch.

  token objective  o_t = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) - beta * KL_k3,t
                   r_t = pi_theta / pi_old, KL_k3 = exp(ref - logp) - (ref - logp) - 1
  grpo     -(1/B) sum_i (1/|o_i|) sum_t o_t          (per-sequence mean, then mean over sequences)
  dapo     -(1 / sum_i |o_i|) sum_i sum_t o_t       (token-level mean over the batch)
  dr_grpo  -(1 / (B * T_max)) sum_i sum_t o_t        (no length normalisation: a constant)
Truncated importance sampling (TIS) multiplies o_t by min(pi_old / mu, cap) where mu is the policy that
sampled (noisy under AQN) and pi_old the loss policy: it corrects the sampler/learner mismatch.
"""

from dataclasses import dataclass

import torch

from ..choices import ALGOS  # the values of `algo` (and of the config's algo.name)


@dataclass(frozen=True)
class LossSettings:
    """The loss of one algorithm; fixed for a run."""

    algo: str = "grpo"  # one of ALGOS: picks the normaliser (module docstring)
    clip_low: float = 0.2  # eps_low: the ratio is clipped below at 1 - clip_low
    clip_high: float = 0.2  # eps_high: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher: 0.28)
    kl_beta: float = 0.0  # beta, weight of the k3 KL to the reference policy (0 = no KL term)
    max_new_tokens: int = 1  # T_max for Dr. GRPO's constant normaliser, tokens


def loss_normalizer(mask: torch.Tensor, s: LossSettings, total_rows: int | None = None,
                    total_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weights [B, T] fp32 such that loss = -(weights * o).sum() for the FULL batch `mask` [B, T].

    total_rows / total_tokens: the whole batch's sequence and token counts when `mask` is one data-parallel
    rank's share (default: this mask's own), so the ranks' summed gradients equal the full batch's.
    """
    m = mask.float()
    rows = mask.shape[0] if total_rows is None else total_rows
    if s.algo == "grpo":
        return m / m.sum(dim=1, keepdim=True).clamp(min=1) / rows
    if s.algo == "dapo":
        return m / (m.sum() if total_tokens is None else total_tokens).clamp(min=1)
    if s.algo == "dr_grpo":
        return m / (rows * s.max_new_tokens)
    raise ValueError(f"unknown algorithm {s.algo!r}; choose one of {ALGOS}")


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    s: LossSettings,
    ref_logp: torch.Tensor | None = None,
    tis: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch, already scaled for the full batch.

    logp [b, T] fp32 with grad (pi_theta); old_logp [b, T] (pi_old, no grad); advantages [b] fp32;
    weights [b, T] from `loss_normalizer` (rows of this micro-batch; 0 where masked); ref_logp [b, T] or
    None; tis [b, T] importance weights or None. Returns (scalar loss, sums for logging — each a 0-d
    tensor to be added over micro-batches: clipped tokens, KL, ratio, token count).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - s.clip_low, 1 + s.clip_high) * adv
    objective = torch.minimum(unclipped, clipped)
    if tis is not None:
        objective = objective * tis
    kl = None
    if ref_logp is not None and s.kl_beta > 0:
        kl = k3_kl(logp, ref_logp)
        objective = objective - s.kl_beta * kl
    loss = -(weights * objective).sum()
    active = weights > 0
    with torch.no_grad():
        stats = {
            "tokens": active.sum().float(),
            "clipped": ((clipped < unclipped) & active).sum().float(),
            "ratio": (ratio * active).sum(),
            "kl": (kl * active).sum() if kl is not None else torch.zeros((), device=logp.device),
        }
    return loss, stats
