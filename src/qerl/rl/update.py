"""The policy update: micro-batched loss and backward over one step's experience, mu optimizer steps.

Which log-probs play pi_old (docs/training.md, "Which log-probs are π_old"): by default ("recompute") the
loss policy itself without noise -- for mu = 1 that is just logp.detach() of the same forward (ratio 1, no
extra pass); for mu > 1 a no-grad pass before the first update. The noisy sampler's log-probs mu(o_t) enter
only through truncated importance sampling, w_t = min(pi_old / mu, tis_cap), which corrects for sampling
from the noisy policy. With old_logprobs="sampling" the ratio is pi_theta / mu directly (PPO's
behaviour-policy ratio) and TIS is not applied.
"""

import dataclasses
import math
import sys
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..choices import OLD_LOGPROBS  # the values of UpdateSettings.old_logprobs (config: algo.old_logprobs)
from ..kernels import dequantized_weights
from ..models.router import original_routers
from ..nn.quant_base import lora_disabled
from .collect import Experience
from .distributed import DistContext, all_reduce_gradients, all_reduce_sum
from .flops import PassLayout, lora_of, update_flops
from .logprobs import completion_logprobs
from .losses import LossSettings, loss_normalizer, policy_loss
from .packing import PackedMicroBatch, needed_tokens, packed_logprobs, plan_micro_batches
from .recompute import RecomputePlan
from .router_aux import capture_router_logits, load_balancing_loss, router_top_k


@dataclass(frozen=True)
class UpdateSettings:
    """How one step's experience becomes optimizer steps; fixed for a run."""

    loss: LossSettings = field(default_factory=LossSettings)
    num_updates: int = 1  # mu: optimizer steps on each rollout batch
    packing: bool = True  # padding-free micro-batches with each group's prompt once (qerl.rl.packing)
    packed_attention: str = "sdpa"  # their attention: "sdpa" or "flex" (qerl.nn.packed_attention.packed_layout)
    # packed path: stream tokens per forward / backward. With gradient checkpointing the activations kept are
    # ~0.4 MB per token at 7B (each layer's bf16 input, 3584 x 2 B x 28 layers, plus one layer's recompute)
    # and ~1.6 MB at 72B, so 8192 tokens hold ~3 GB / ~13 GB: room beside the weights on one 80 GB card
    max_tokens_per_micro_batch: int = 8192
    micro_batch_size: int = 8  # padded path (packing=False): sequences per forward / backward
    max_grad_norm: float = 1.0  # clip the LoRA gradient to this global L2 norm
    temperature: float = 1.0  # the rollout's sampling temperature (0 = greedy): log-probs are taken under it
    old_logprobs: str = "recompute"  # one of OLD_LOGPROBS: which log-probs play pi_old (module docstring)
    tis_cap: float | None = 2.0  # truncated importance sampling cap, w_t = min(pi_old / mu, tis_cap); None = off
    # MoE: weight of the routers' load-balancing loss (`router_aux`) added to the policy loss; 0 = off
    aux_loss_coef: float = 0.0

    def __post_init__(self):
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"unknown old_logprobs {self.old_logprobs!r}; choose one of {OLD_LOGPROBS}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


class NonFiniteError(RuntimeError):
    """A loss or gradient was NaN/Inf; the optimizer step was skipped."""


def _micro_batches(exp: Experience, s: UpdateSettings) -> list[PackedMicroBatch | slice]:
    """One pass's micro-batches: packed ones, or row slices of `micro_batch_size` padded sequences."""
    if s.packing:
        return plan_micro_batches(exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask,
                                  s.max_tokens_per_micro_batch, s.packed_attention)
    n, size = len(exp.rewards), s.micro_batch_size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _rows(mb: PackedMicroBatch | slice) -> slice:
    return mb.rows if isinstance(mb, PackedMicroBatch) else mb


def _token_counts(exp: Experience, batches: list[PackedMicroBatch | slice]) -> tuple[int, int]:
    """(tokens one pass forwards, tokens it needs: each distinct prompt once per group + the loss tokens).
    The padded path forwards every row's full [P + T] width; it counts what it needs with a host sync."""
    if batches and isinstance(batches[0], PackedMicroBatch):
        return sum(mb.computed_tokens for mb in batches), sum(mb.needed_tokens for mb in batches)
    return (exp.prompt_ids.numel() + exp.completion_ids.numel(),
            needed_tokens(exp.prompt_ids, exp.prompt_mask, exp.completion_mask))


def _pass_layout(exp: Experience, batches: list[PackedMicroBatch | slice]) -> PassLayout:
    """The tokens one pass forwards, for its FLOPs (`qerl.rl.flops`): the packed streams' runs, or each padded row's
    real prompt and loss tokens as one sequence (its padding left out; a host sync); the LM head takes the loss
    tokens."""
    if batches and isinstance(batches[0], PackedMicroBatch):
        return PassLayout(tuple(seg for mb in batches for seg in mb.segments),
                          sum(mb.target_index.numel() for mb in batches))
    prompt, loss = exp.prompt_mask.sum(1).tolist(), exp.completion_mask.sum(1).tolist()
    return PassLayout(tuple((0, int(p + n)) for p, n in zip(prompt, loss) if n), int(sum(loss)))


def _logprobs(model, exp: Experience, mb: PackedMicroBatch | slice, temperature: float) -> torch.Tensor:
    if isinstance(mb, PackedMicroBatch):
        return packed_logprobs(model, mb, exp.completion_ids, temperature)
    return completion_logprobs(model, exp.prompt_ids[mb], exp.prompt_mask[mb], exp.completion_ids[mb],
                               exp.completion_mask[mb], temperature)


def _forward_tokens(exp: Experience, mb: PackedMicroBatch | slice) -> torch.Tensor | None:
    """The real-token mask of a micro-batch's forward for the load-balancing loss: None for a packed one
    (its stream has no padding), else the padded rows' attention mask [b, P + T]."""
    if isinstance(mb, PackedMicroBatch):
        return None
    return torch.cat([exp.prompt_mask[mb], exp.completion_mask[mb]], dim=1)


def _aux_token_count(exp: Experience, mb: PackedMicroBatch | slice) -> torch.Tensor:
    """Real tokens one micro-batch forwards (the load-balancing loss's N), fp32 0-d on the experience's device."""
    if isinstance(mb, PackedMicroBatch):
        return torch.tensor(float(mb.computed_tokens), device=exp.completion_ids.device)
    return _forward_tokens(exp, mb).sum().float()


def _forward_tokens_max(exp: Experience, batches: list[PackedMicroBatch | slice]) -> int:
    """Tokens the largest micro-batch forwards (padded rows count their full [P + T] width)."""
    if batches and isinstance(batches[0], PackedMicroBatch):
        return max(mb.computed_tokens for mb in batches)
    width = exp.prompt_ids.shape[1] + exp.completion_ids.shape[1]
    return max(((mb.stop - mb.start) * width for mb in batches), default=0)


PROBE_PROMPT_TOKENS = 16


def _probe_forward(model, exp: Experience, s: UpdateSettings) -> Callable[[int], torch.Tensor]:
    """forward(n): the loss pass's log-probs (grad enabled by the caller) of one synthetic row of n tokens, a
    16-token prompt and its completion, through the same path as the update's micro-batches (`qerl.rl.recompute`'s
    probe)."""
    device = exp.completion_ids.device
    vocab = min(int(getattr(model.config, "vocab_size", 1000)), 1000)

    def forward(n: int) -> torch.Tensor:
        ids = (torch.arange(n, device=device) * 7 % vocab)[None].to(exp.prompt_ids.dtype)
        prompt, completion = ids[:, :PROBE_PROMPT_TOKENS], ids[:, PROBE_PROMPT_TOKENS:]
        pmask, cmask = torch.ones_like(prompt, dtype=torch.bool), torch.ones_like(completion, dtype=torch.bool)
        if s.packing:
            mb = plan_micro_batches(prompt, pmask, completion, cmask, n, s.packed_attention)[0]
            return packed_logprobs(model, mb, completion, s.temperature)
        return completion_logprobs(model, prompt, pmask, completion, cmask, s.temperature)

    return forward


@torch.no_grad()
def _no_grad_logprobs(model, exp: Experience, batches, temperature: float) -> torch.Tensor:
    return torch.cat([_logprobs(model, exp, mb, temperature) for mb in batches])


def policy_update(model, exp: Experience, optimizer, params, settings: UpdateSettings, *,
                  dist_ctx: DistContext = DistContext(), timings: dict[str, float] | None = None,
                  dense_store: dict | None = None,
                  phase: Callable[[str], AbstractContextManager] | None = None,
                  recompute: RecomputePlan | None = None) -> dict[str, float]:
    """Run `settings.num_updates` optimizer steps on `exp`. Raises NonFiniteError (after zeroing grads) when the
    gradient norm is not finite -- a NaN/Inf loss makes it so -- and the step is skipped: the caller counts it.

    params: the trainable (LoRA) parameters the optimizer holds; their gradients are all-reduced over
    `dist_ctx`'s ranks. Statistics stay on the device until the end: one host sync per optimizer step (the
    grad norm check). With a `timings` dict, seconds per phase are added to it ("reference", "old_logprobs",
    "loss_backward", "optimizer"; "optimizer" includes the gradient all-reduce); that synchronizes the device
    at phase ends. dense_store: the 16-bit copies of the 4-bit linear weights the passes use (made on first
    use, kept by the caller; `kernels.dequant_cache`, the trainer's model.dense_weights); None: the 4-bit kernels.
    phase: called with each phase's name, a context manager entered around that phase (inside its timing; e.g.
    `qerl bench step --busy`'s profiler), or None.

    Besides the loss statistics it returns `loss_tokens_computed` and `loss_tokens_needed`: the tokens ONE
    forward pass over the batch runs through the model (the reference, old-log-prob and each policy pass
    all run the same micro-batches) and the tokens it needs (each distinct prompt once per group plus the
    loss tokens); with packing their ratio is the prompt repetition of groups split over micro-batches. And
    `update_flops`: the useful FLOPs of the whole update (every pass, `qerl.rl.flops`), left out for a model
    that count does not know.

    With `settings.aux_loss_coef` > 0 (MoE models) each micro-batch's forward also gives the routers'
    load-balancing loss over its real tokens (`router_aux`), added to the policy loss times the coefficient and
    the micro-batch's share of the whole (all-rank) batch's forward tokens; `aux_loss` is then returned too:
    this rank's token-weighted mean of the micro-batch values.

    recompute: which decoder layers recompute in the backward (`optim.gradient_checkpointing`), planned for this
    update's largest micro-batch; `recomputed_layers` is then returned too (and, for auto on CUDA,
    `recompute_fallbacks`: the run's fallbacks so far). If an update planned with plain
    layers runs out of memory before its first optimizer step, it runs again with half as many, and later plans
    keep at most that many (`RecomputePlan.fall_back`; a line on stderr says so); under data parallel the error
    is raised instead (a retry on one rank would desynchronise the all-reduces). None: the layers as they are.
    """
    on_cpu = exp.completion_ids.device.type == "cpu"
    # CPU: dequantize each weight once for the whole update; with a store, once for the run, on any device
    with dequantized_weights(enabled=on_cpu or dense_store is not None, store=dense_store):
        progress = {"stepped": False}
        while True:
            try:
                return _update(model, exp, optimizer, params, settings, dist_ctx, timings, phase, recompute, progress)
            except torch.OutOfMemoryError:
                plain = 0 if recompute is None else len(recompute.layers) - (recompute.recomputed or 0)
                # data parallel: a retry would call the collectives again while the other ranks wait in theirs
                if recompute is None or progress["stepped"] or dist_ctx.enabled or not recompute.fall_back():
                    raise
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(f"qerl: out of GPU memory with {plain} plain layers in the backward (optim.gradient_checkpointing "
                  f"auto); the update runs again with {recompute.max_plain}, and later ones with at most that many",
                  file=sys.stderr)


@contextmanager
def _phase(timings: dict[str, float] | None, name: str, device: torch.device, hook=None):
    inner = nullcontext() if hook is None else hook(name)
    if timings is None:
        with inner:
            yield
        return
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with inner:
        yield
        sync()
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _update(model, exp: Experience, optimizer, params, s: UpdateSettings, dist_ctx: DistContext,
            timings: dict[str, float] | None, hook, recompute: RecomputePlan | None,
            progress: dict) -> dict[str, float]:
    device = exp.completion_ids.device
    mask = exp.completion_mask
    batches = _micro_batches(exp, s)  # one plan for the reference, old and policy passes
    aux = s.aux_loss_coef > 0
    aux_tokens = [_aux_token_count(exp, mb) for mb in batches] if aux else []
    local_aux_tokens = torch.stack(aux_tokens).sum().item() if aux_tokens else 0.0
    # the whole (all-rank) batch's counts, so that summed gradients equal one big batch's
    counts = all_reduce_sum(torch.tensor([float(mask.shape[0]), float(mask.sum()), local_aux_tokens],
                                         device=dist_ctx.device), dist_ctx)
    weights = loss_normalizer(mask, s.loss, total_rows=int(counts[0]), total_tokens=counts[1].to(mask.device))
    experts_k = router_top_k(model) if aux else None
    ref = None
    if s.loss.kl_beta > 0:  # adapters off and routers at their base weights; no second copy
        with _phase(timings, "reference", device, hook), lora_disabled(model), original_routers(model):
            ref = _no_grad_logprobs(model, exp, batches, s.temperature)
    old = exp.sampling_logp if s.old_logprobs == "sampling" else None
    old_pass = old is None and s.num_updates > 1
    if old_pass:
        with _phase(timings, "old_logprobs", device, hook):
            old = _no_grad_logprobs(model, exp, batches, s.temperature)
    use_tis = s.old_logprobs == "recompute" and s.tis_cap is not None
    zero = torch.zeros((), device=mask.device)
    totals = {k: zero.clone() for k in ("tokens", "clipped", "ratio", "kl", "loss", "tis_mean", "aux")}
    grad_norm = 0.0
    model.train()
    try:
        if recompute is not None:  # in train mode: the probe's forward then saves what the loss pass's does
            recompute.plan(_forward_tokens_max(exp, batches), _probe_forward(model, exp, s))
        for _ in range(s.num_updates):
            optimizer.zero_grad(set_to_none=True)
            with _phase(timings, "loss_backward", device, hook):
                for i, mb in enumerate(batches):
                    sl = _rows(mb)
                    with capture_router_logits(model) if aux else nullcontext([]) as router_logits:
                        logp = _logprobs(model, exp, mb, s.temperature)
                    old_mb = logp.detach() if old is None else old[sl]
                    tis = None
                    if use_tis:
                        tis = torch.exp(old_mb - exp.sampling_logp[sl]).clamp(max=s.tis_cap) * mask[sl]
                        totals["tis_mean"] += tis.sum()
                    loss, stats = policy_loss(logp, old_mb, exp.advantages[sl], weights[sl], s.loss,
                                              None if ref is None else ref[sl], tis)
                    if router_logits:  # none when the micro-batch had no token to forward
                        aux_mb = load_balancing_loss(router_logits, *experts_k, _forward_tokens(exp, mb))
                        loss = loss + s.aux_loss_coef * aux_tokens[i] / counts[2].to(device) * aux_mb
                        totals["aux"] += aux_mb.detach() * aux_tokens[i]
                        router_logits.clear()  # drop the graph references before the backward
                    if loss.requires_grad:  # a packed micro-batch without loss tokens runs no forward
                        loss.backward()
                    totals["loss"] += loss.detach()
                    for k, v in stats.items():
                        totals[k] += v
            with _phase(timings, "optimizer", device, hook):
                for p in params:  # no loss token anywhere: the zero gradient the padded path computes
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                all_reduce_gradients(params, dist_ctx)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm))
                if not math.isfinite(grad_norm):
                    raise NonFiniteError(f"non-finite gradient norm {grad_norm} (loss {totals['loss'].item()})")
                progress["stepped"] = True
                optimizer.step()
    except NonFiniteError:
        optimizer.zero_grad(set_to_none=True)
        raise
    finally:
        model.eval()
    t = {k: v.item() for k, v in totals.items()}
    computed, needed = _token_counts(exp, batches)
    tokens = max(t["tokens"], 1.0)
    extra = {"aux_loss": t["aux"] / max(local_aux_tokens, 1.0) / s.num_updates} if aux else {}
    config = getattr(model, "config", None)
    flops = None if config is None else update_flops(config, _pass_layout(exp, batches), lora_of(model),
                                                     loss_passes=s.num_updates, old_logprob_pass=old_pass,
                                                     reference_pass=ref is not None)
    if flops is not None:
        extra["update_flops"] = float(flops)
    if recompute is not None and recompute.recomputed is not None:
        extra["recomputed_layers"] = float(recompute.recomputed)
        if recompute.adaptive:  # the run's out-of-memory fallbacks so far
            extra["recompute_fallbacks"] = float(recompute.fallbacks)
    return {
        "loss": t["loss"] / s.num_updates,
        "clip_fraction": t["clipped"] / tokens,
        "ratio_mean": t["ratio"] / tokens,
        "kl": t["kl"] / tokens,
        "tis_weight_mean": t["tis_mean"] / tokens if use_tis else 1.0,
        "grad_norm": grad_norm,
        "loss_tokens_computed": float(computed),
        "loss_tokens_needed": float(needed),
        **extra,
    }


def data_parallel_gradient_check(model, params, settings: UpdateSettings, batch: Experience, group: int,
                                 dist_ctx: DistContext) -> tuple[float, float]:
    """(error, noise floor) of the data-parallel update on `batch`, the whole global batch (every rank holds it).
    error = ||g_dist - g_one|| / ||g_one||: the gradient all-reduced over the ranks' shares (whole groups of `group`
    rows, every world-th from the rank, as the trainer splits prompts) against the single-process gradient of the
    whole batch (computed on every rank; rank 0's is reported). noise floor = the same distance between two
    single-process gradients of the whole batch that differ only in micro-batch size: what bf16 rounding alone
    moves. The weights do not change (SGD at lr 0); the gradients are left in .grad."""
    tensors = [f for f in Experience.__dataclass_fields__ if f not in ("texts", "stats")]
    device = next(iter(params)).device
    full = Experience(*(getattr(batch, f).to(device) for f in tensors))

    def grads(exp, ctx, micro=settings.micro_batch_size):
        sgd = torch.optim.SGD(params, lr=0.0)  # lr 0: the weights stay, the gradient stays in .grad
        once = dataclasses.replace(settings, micro_batch_size=micro, max_grad_norm=1e9)  # no clipping
        policy_update(model, exp, sgd, params, once, dist_ctx=ctx)
        return torch.cat([p.grad.flatten().float() for p in params])

    flat = torch.cat([p.detach().flatten().float() for p in params])
    if not torch.equal(all_reduce_sum(flat.clone(), dist_ctx) / dist_ctx.world, flat):
        raise RuntimeError("ranks hold different LoRA weights; the gradient check needs identical policies")
    one = grads(full, DistContext())
    rows = len(full.rewards)
    share = torch.arange(rows, device=device).view(rows // group, group)[dist_ctx.rank::dist_ctx.world].flatten()
    both = grads(Experience(*(getattr(full, f)[share] for f in tensors)), dist_ctx)
    reshuffled = grads(full, DistContext(), micro=max(1, settings.micro_batch_size // 2))

    def rel(a):
        return float((a - one).norm() / one.norm().clamp(min=1e-30))

    return rel(both), rel(reshuffled)
