"""One RL step: the one `qerl train` runs (`Trainer.train_step`) and `qerl bench step` times (`StepRunner.step`).

    experience (rollout with AQN at the step's sigma, rewards, advantages: the caller's `collect`)
    -> the engine's memory policy after the rollout (free or keep its KV cache and graphs)
    -> the policy update (reference pass, loss, backward, optimizer; `policy_update`)
    -> the memory policy after the update -> the learning-rate schedule's step

What differs between the two callers stays with them: the trainer samples its prompts, scores them and assembles,
logs and counts its metrics; the benchmark rolls out random prompts to forced lengths with random rewards and
times the phases with the device synchronised (`synchronize=True`).
"""

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from ..rollout.memory import EngineMemoryPolicy
from .collect import Experience
from .distributed import DistContext
from .recompute import RecomputePlan
from .update import NonFiniteError, UpdateSettings, policy_update


@dataclass
class StepResult:
    """What one step did. times: seconds, "rollout" (collect and the memory policy after it), "step" (all of
    it), plus the update's phases with `synchronize`; update: `policy_update`'s statistics, None when the
    update did not run (no loss token, one process) or met a non-finite gradient (`non_finite`: the optimizer
    step was skipped, the rest of the step ran)."""

    experience: Experience
    update: dict[str, float] | None
    times: dict[str, float]
    non_finite: NonFiniteError | None = None


def rl_step(collect: Callable[[], Experience], *, model, engine, memory: EngineMemoryPolicy, optimizer, params,
            settings: UpdateSettings, dist_ctx: DistContext = DistContext(), dense_store: dict | None = None,
            scheduler=None, synchronize: bool = False, times: dict[str, float] | None = None,
            run_update: Callable[[Callable[[], dict]], dict] | None = None,
            phase: Callable[[str], AbstractContextManager] | None = None,
            recompute: RecomputePlan | None = None) -> StepResult:
    """Run one step (module docstring) on `model` (LoRA `params` under `optimizer`) and `engine`.

    collect: () -> this rank's Experience (it runs the rollout on `engine`); memory: the engine's memory policy;
    scheduler: a learning-rate scheduler stepped at the end, or None; dense_store: the update's 16-bit weight
    copies (`policy_update`). synchronize: wait for the device before reading the clock at the end of the rollout
    and of the step, and time the update's phases (reference, old_logprobs, loss_backward, optimizer; each then
    synchronises): exact per-phase times, at the cost of a few device syncs. times: the dict the times go into
    (a new one when None). run_update: called with a no-argument function that runs the update, returns what it
    returns (e.g. under a profiler); None calls it directly. phase: called with "rollout" and each of the
    update's phase names, a context manager entered around that phase (`policy_update`), or None. recompute:
    which decoder layers recompute in the backward, planned per update (`policy_update`), or None."""
    on_gpu = synchronize and model.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    times = {} if times is None else times
    start = time.perf_counter()
    with nullcontext() if phase is None else phase("rollout"):
        exp = collect()
        memory.after_rollout(engine)
        sync()
    times["rollout"] = time.perf_counter() - start
    stats, non_finite = None, None
    if exp.completion_mask.any() or dist_ctx.enabled:  # every rank must join the gradient all-reduce

        def update() -> dict:
            return policy_update(model, exp, optimizer, params, settings, dist_ctx=dist_ctx,
                                 timings=times if synchronize else None, dense_store=dense_store, phase=phase,
                                 recompute=recompute)

        try:
            stats = update() if run_update is None else run_update(update)
        except NonFiniteError as e:
            non_finite = e
    memory.after_update()
    if scheduler is not None:
        scheduler.step()
    sync()
    times["step"] = time.perf_counter() - start
    return StepResult(exp, stats, times, non_finite)
