"""What a rollout returns: `Rollout`, the sampled completions of a batch with their log-probs, and how to
join the results of several passes into one."""

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class Rollout:
    """What `generate` returns; every tensor on the engine's device, rows in prompt order.

    prompt_ids      [B, P] int64, left-padded with pad_token_id; prompt_mask [B, P] bool (True = real token)
    completion_ids  [B, T] int64, right-padded with pad_token_id after the end of each completion
    completion_mask [B, T] bool, True for generated tokens up to and including the stop token (EOS or the
                    token that completed a stop string)
    logprobs        [B, T] fp32, log pi(token) under softmax(logits / T) of the policy that sampled
                    (noise included when AQN is on); 0 where the mask is False
    entropies       [B, T] fp32, entropy of that distribution at each position; 0 where the mask is False
    finish_reason   per row "stop" (EOS or stop string) or "length"
    stats           work counts of the call (`RolloutEngine.generate`): decoded_row_steps, kept_tokens,
                    prefill_tokens, prefill_rows
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor
    finish_reason: list[str] = field(default_factory=list)
    texts: list[str] | None = None
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64 number of completion tokens per row."""
        return self.completion_mask.sum(-1)

    @staticmethod
    def concat(parts: Sequence["Rollout"], pad_token_id: int) -> "Rollout":
        """Rows of all parts in order; prompts re-left-padded and completions re-right-padded to the widest."""
        return Rollout(
            _pad_cat([r.prompt_ids for r in parts], pad_token_id, left=True),
            _pad_cat([r.prompt_mask for r in parts], False, left=True),
            _pad_cat([r.completion_ids for r in parts], pad_token_id, left=False),
            _pad_cat([r.completion_mask for r in parts], False, left=False),
            _pad_cat([r.logprobs for r in parts], 0.0, left=False),
            _pad_cat([r.entropies for r in parts], 0.0, left=False),
            [f for r in parts for f in r.finish_reason],
            None if any(r.texts is None for r in parts) else [t for r in parts for t in r.texts],
            {k: sum(r.stats.get(k, 0) for r in parts) for k in {k for r in parts for k in r.stats}})


def _pad_cat(tensors: Sequence[torch.Tensor], value, left: bool) -> torch.Tensor:
    """Concatenate [n_i, L_i] tensors (any dtype) along rows, padding each with `value` to max L_i on the
    left or right."""
    width = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
        out.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(out)
