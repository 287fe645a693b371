"""Log-probabilities of sampled completions under the training forward (the loss policy).

The vocabulary projection is done in chunks of positions, each recomputed in the backward
(activation checkpointing), so no [tokens x vocab] fp32 tensor for the whole batch ever exists: at most
one chunk of about `chunk_bytes` lives at a time.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..rollout.sampling import logprob_temperature

DEFAULT_CHUNK_BYTES = 256 * 2**20


def _token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """hidden [n, D], lm_head weight [V, D], targets int64 [n] -> log softmax(h W^T / T)[target], fp32 [n]."""
    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                           chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """hidden [B, T, D], weight [V, D], targets [B, T] -> fp32 [B, T]; chunks recomputed in backward."""
    B, T, D = hidden.shape
    flat_h, flat_t = hidden.reshape(B * T, D), targets.reshape(B * T)
    step = max(1, chunk_bytes // (4 * weight.shape[0]))
    outs = []
    for i in range(0, B * T, step):
        h, t = flat_h[i:i + step], flat_t[i:i + step]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(_token_logprobs, h, weight, t, temperature, use_reentrant=False))
        else:
            outs.append(_token_logprobs(h, weight, t, temperature))
    return torch.cat(outs).view(B, T)


def completion_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                        completion_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(completion token | prefix) under softmax(logits / tau), fp32 [B, T] (0 where masked).

    prompt_ids / prompt_mask [B, P] left-padded (as the rollout engine returns them), completion_ids /
    completion_mask [B, T] right-padded. Positions count real tokens only, so padding does not shift RoPE.
    temperature: the sampling temperature the completions were drawn with (0 = greedy);
    tau = `logprob_temperature(temperature)`.
    """
    P = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    hidden = out.last_hidden_state
    # the hidden state at position j predicts token j + 1
    h = hidden[:, P - 1:-1]
    tau = logprob_temperature(temperature)
    logp = chunked_token_logprobs(h, model.lm_head.weight, completion_ids, tau)
    return logp * completion_mask
