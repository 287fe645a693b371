"""Turning next-token logits into tokens, on the device, with no host synchronisation.

Every function here takes and returns device tensors and never calls `.item()`, `.tolist()` or a
data-dependent branch, so a decode loop built from them runs ahead of the GPU (`philox_seed`, one host read
per rollout, is the exception). On CUDA the engine replaces `next_token` and its bookkeeping by one Triton
launch where `fused_sampling_applies` (`qerl.kernels.triton.sampling`: same distribution and statistics).

Conventions: `logits` are [B, V] (any float dtype; the math runs in fp32). `temperature == 0` means
greedy. The recorded log-probs and entropies are those of the *temperature-scaled, untruncated*
distribution softmax(logits / T) (T = 1 for greedy): that is exactly what the trainer's forward computes
for pi_old, so the ratio pi_theta / pi_old is 1 at the first update. top-k / top-p only decide which token
is drawn; their renormalised truncated distribution is not what is recorded (say so wherever it matters).
"""

from dataclasses import dataclass

import torch

from ..kernels.route import triton_enabled


@dataclass(frozen=True)
class SamplingParams:
    """How to draw each next token. temperature 0 = greedy; top_k 0 and top_p 1.0 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logprob_temperature(sampling_temperature: float) -> float:
    """The T of softmax(logits / T) under which a completion's log-probs are taken: the sampling temperature,
    or 1 for greedy decoding (temperature 0), which has no distribution of its own. The sampler records
    its log-probs under this T and the loss takes them under it too, so the ratio pi_theta / pi_old starts at 1."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


def logits_to_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [B, V] -> log softmax(logits / T) [B, V] fp32, T = logprob_temperature(temperature)."""
    return torch.log_softmax(logits.float() / logprob_temperature(temperature), dim=-1)


def entropy_from_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """logprobs [B, V] fp32 -> entropy -sum p log p [B] fp32 (0 * -inf counted as 0)."""
    p = logprobs.exp()
    return -(p * logprobs.masked_fill(p == 0, 0.0)).sum(-1)


def truncate_logits(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the top-p nucleus. [B, V] -> [B, V].

    The nucleus keeps the smallest set of most likely tokens whose mass reaches top_p (the token that
    crosses the threshold is kept), always at least one token.
    """
    out = logprobs
    if top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # [B, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, idx = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_lp, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           exponentials=None) -> torch.Tensor:
    """Draw one token per row. logprobs [B, V] fp32 (already temperature-scaled) -> tokens [B] int64.

    Sampling is argmax(log p - log E), E ~ Exp(1) (the exponential race, equivalent to the Gumbel-max
    trick): one elementwise pass and an argmax, no multinomial and no host sync. E comes from `generator`, or
    from exponentials(like) -> fp32 [B, V] when given (`keyed_exponentials`).
    """
    if params.greedy:
        return logprobs.argmax(-1)
    lp = truncate_logits(logprobs, params.top_k, params.top_p)
    e = torch.empty_like(lp).exponential_(generator=generator) if exponentials is None else exponentials(lp)
    # clamp: an exact 0 draw would give -inf - log 0 = nan on a masked token
    return (lp - e.clamp_min_(1e-30).log()).argmax(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, exponentials=None):
    """One sampling step. logits [B, V] -> (tokens [B] int64, logprob of each token [B] fp32,
    entropy [B] fp32), both under softmax(logits / T). exponentials: as in `sample`."""
    logprobs = logits_to_logprobs(logits, params.temperature)
    tokens = sample(logprobs, params, generator, exponentials)
    token_logprob = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, token_logprob, entropy_from_logprobs(logprobs)


KEY_STRIDE = 2**20  # draw-counter positions per sequence: completions of up to 2^20 tokens


def draw_key(sequence: int, start_step: int) -> int:
    """The draw counter of `sequence` (its index in the generate call) started at decode step `start_step`:
    token p is drawn at step start_step + p with counter key + step = sequence * KEY_STRIDE + p, so its
    draws depend on (seed, sequence, p) only, never on the row, batch or step it ran at."""
    return sequence * KEY_STRIDE - start_step


def keyed_exponentials(seed: int, keys: list[int], step: int):
    """For `sample`: Exp(1) draws where row b's come from a generator seeded by (seed, keys[b] + step) alone
    (`draw_key`); keys are host ints (no device read). The engine's eager sampler (CPU, and CUDA with top-k /
    top-p) uses it so that a sequence's draws do not depend on its row."""
    def draw(like: torch.Tensor) -> torch.Tensor:
        e = torch.empty_like(like)
        gen = torch.Generator(like.device)
        for b, key in enumerate(keys):
            gen.manual_seed(hash((seed, key + step)) & (2**63 - 1))
            e[b].exponential_(generator=gen)
        return e
    return draw


def fused_sampling_applies(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether one Triton launch (`qerl.kernels.triton.sampling`) can draw from these logits [B, V]: CUDA,
    unit column stride, no top-k / top-p truncation (those need a sort: the eager path keeps them),
    Triton importable and QERL_DISABLE_TRITON unset."""
    return (logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and params.top_k == 0
            and params.top_p == 1.0 and triton_enabled())


def philox_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """A seed in [2^32, 2^62) for the fused sampler's counter-based draws, taken from `generator` (torch's
    default generator of `device` when None), so seeding works as for the eager sampler. One host sync:
    call it once per rollout, then number its steps."""
    dev = generator.device if generator is not None else device
    return int(torch.randint(2**32, 2**62, (1,), generator=generator, device=dev).item())
