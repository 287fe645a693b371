"""Group-relative advantages (GRPO, Dr. GRPO) and DAPO's reward shaping (arXiv 2503.14476); docs/training.md,
"One step"."""

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards fp32 [N] (N = prompts x G, each prompt's G completions adjacent) -> advantages fp32 [N].

    A_i = R_i - mean(R_group), divided by (std(R_group) + eps) when `scale` (GRPO; Dr. GRPO leaves it out).
    The std is the unbiased sample std, as in GRPO / TRL; a group with equal rewards gets all-zero advantages.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got {tuple(rewards.shape)}")
    groups = rewards.float().view(-1, group_size)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (groups.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def mixed_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [N / G]: groups whose rewards are not all equal (DAPO dynamic sampling keeps only these:
    with 0 < #correct < G the group has a learning signal)."""
    groups = rewards.view(-1, group_size)
    return (groups != groups[:, :1]).any(dim=1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment, fp32 [N] from completion lengths [N]:
    0 up to max_len - buffer, then linear down to -1 at max_len, -1 beyond."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    start = max_len - buffer
    penalty = (start - lengths.float()) / buffer
    return penalty.clamp(min=-1.0, max=0.0)
