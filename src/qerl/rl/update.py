"""The policy update: micro-batched loss and backward over one step's experience, mu optimizer steps.

Which log-probs play pi_old (DESIGN.md, AQN): by default ("recompute") the loss policy itself without
noise -- for mu = 1 that is just logp.detach() of the same forward (ratio 1, no extra pass); for mu > 1 a
no-grad pass before the first update. The noisy sampler's log-probs mu(o_t) enter only through
truncated importance sampling, w_t = min(pi_old / mu, tis_cap), which corrects for sampling from the
noisy policy. With old_logprobs="sampling" the ratio is pi_theta / mu directly (PPO's behaviour-policy
ratio) and TIS is not applied.
"""

import math
import time
from contextlib import contextmanager

import torch

from ..kernels import dequantized_weights
from ..nn.quant_linear import lora_disabled
from .collect import Experience
from .distributed import DistContext, all_reduce_gradients, all_reduce_sum
from .logprobs import completion_logprobs
from .losses import LossSettings, loss_normalizer, policy_loss


class NonFiniteError(RuntimeError):
    """A loss or gradient was NaN/Inf; the optimizer step was skipped."""


def _micro_batches(n: int, size: int):
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _logprobs(model, exp: Experience, sl: slice, temperature: float) -> torch.Tensor:
    return completion_logprobs(model, exp.prompt_ids[sl], exp.prompt_mask[sl], exp.completion_ids[sl],
                               exp.completion_mask[sl], temperature)


@torch.no_grad()
def _no_grad_logprobs(model, exp: Experience, micro: int, temperature: float) -> torch.Tensor:
    return torch.cat([_logprobs(model, exp, sl, temperature) for sl in _micro_batches(len(exp.rewards), micro)])


def policy_update(model, exp: Experience, optimizer, params, settings: LossSettings, *, num_updates: int,
                  micro_batch_size: int, max_grad_norm: float, temperature: float, old_logprobs: str,
                  tis_cap: float | None, dist_ctx: DistContext = DistContext(),
                  timings: dict[str, float] | None = None) -> dict[str, float]:
    """Run `num_updates` optimizer steps on `exp`. Raises NonFiniteError (after zeroing grads) when the
    gradient norm is not finite -- a NaN/Inf loss makes it so -- and the step is skipped: the caller counts it.

    Statistics stay on the device until the end: one host sync per optimizer step (the grad norm check).
    With a `timings` dict, seconds per phase are added to it ("reference", "old_logprobs", "loss_backward",
    "optimizer"; "optimizer" includes the gradient all-reduce); that synchronizes the device at phase ends.
    """
    on_cpu = exp.completion_ids.device.type == "cpu"
    with dequantized_weights(enabled=on_cpu):  # CPU: dequantize each weight once for the whole update
        return _update(model, exp, optimizer, params, settings, num_updates, micro_batch_size, max_grad_norm,
                       temperature, old_logprobs, tis_cap, dist_ctx, timings)


@contextmanager
def _phase(timings: dict[str, float] | None, name: str, device: torch.device):
    if timings is None:
        yield
        return
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    yield
    sync()
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _update(model, exp, optimizer, params, settings, num_updates, micro_batch_size, max_grad_norm, temperature,
            old_logprobs, tis_cap, dist_ctx, timings=None) -> dict[str, float]:
    device = exp.completion_ids.device
    mask = exp.completion_mask
    # the whole (all-rank) batch's counts, so that summed gradients equal one big batch's
    counts = all_reduce_sum(torch.tensor([float(mask.shape[0]), float(mask.sum())], device=dist_ctx.device), dist_ctx)
    weights = loss_normalizer(mask, settings, total_rows=int(counts[0]), total_tokens=counts[1].to(mask.device))
    batches = _micro_batches(len(exp.rewards), micro_batch_size)
    ref = None
    if settings.kl_beta > 0:
        with _phase(timings, "reference", device), lora_disabled(model):  # adapters off; no second copy
            ref = _no_grad_logprobs(model, exp, micro_batch_size, temperature)
    old = exp.sampling_logp if old_logprobs == "sampling" else None
    if old is None and num_updates > 1:
        with _phase(timings, "old_logprobs", device):
            old = _no_grad_logprobs(model, exp, micro_batch_size, temperature)
    use_tis = old_logprobs == "recompute" and tis_cap is not None
    zero = torch.zeros((), device=mask.device)
    totals = {k: zero.clone() for k in ("tokens", "clipped", "ratio", "kl", "loss", "tis_mean")}
    grad_norm = 0.0
    model.train()
    try:
        for _ in range(num_updates):
            optimizer.zero_grad(set_to_none=True)
            with _phase(timings, "loss_backward", device):
                for sl in batches:
                    logp = _logprobs(model, exp, sl, temperature)
                    old_mb = logp.detach() if old is None else old[sl]
                    tis = None
                    if use_tis:
                        tis = torch.exp(old_mb - exp.sampling_logp[sl]).clamp(max=tis_cap) * mask[sl]
                        totals["tis_mean"] += tis.sum()
                    loss, stats = policy_loss(logp, old_mb, exp.advantages[sl], weights[sl], settings,
                                              None if ref is None else ref[sl], tis)
                    loss.backward()
                    totals["loss"] += loss.detach()
                    for k, v in stats.items():
                        totals[k] += v
            with _phase(timings, "optimizer", device):
                all_reduce_gradients(params, dist_ctx)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
                if not math.isfinite(grad_norm):
                    raise NonFiniteError(f"non-finite gradient norm {grad_norm} (loss {totals['loss'].item()})")
                optimizer.step()
    except NonFiniteError:
        optimizer.zero_grad(set_to_none=True)
        raise
    finally:
        model.eval()
    t = {k: v.item() for k, v in totals.items()}
    tokens = max(t["tokens"], 1.0)
    return {
        "loss": t["loss"] / num_updates,
        "clip_fraction": t["clipped"] / tokens,
        "ratio_mean": t["ratio"] / tokens,
        "kl": t["kl"] / tokens,
        "tis_weight_mean": t["tis_mean"] / tokens if use_tis else 1.0,
        "grad_norm": grad_norm,
    }
