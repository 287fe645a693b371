"""A training step's metrics (the row of `metrics.jsonl`) and the line the console prints for it.

The keys are a contract: plots, the resume test's comparison and users' notebooks read them; one function
builds them so a new key is added in one place.
"""

import torch


def experience_metrics(exp, step: int, sigma: float, stage: int, lr: float) -> dict:
    """What the rollout of step `step` (1-based) sampled: rewards, entropy, lengths and the engine's speed."""
    gen_mask = exp.lengths.unsqueeze(1) > torch.arange(exp.entropies.shape[1], device=exp.completion_mask.device)
    stats = exp.stats
    return {
        "step": step,
        **{k: v for k, v in stats.items() if k not in ("gen_tokens", "gen_seconds")},
        "reward": float(exp.rewards.mean()),
        "entropy": float((exp.entropies * gen_mask).sum() / gen_mask.sum().clamp(min=1)),
        "aqn_sigma": sigma,
        "aqn_stage": stage,
        "response_length": float(exp.lengths.float().mean()),
        "truncated_fraction": float(exp.truncated.float().mean()),
        "tokens_per_s": stats["gen_tokens"] / max(stats["gen_seconds"], 1e-9),
        "time_generate": stats["gen_seconds"],  # the engine alone (time_rollout adds rewards and selection)
        # work per useful token: decoded row-steps per kept completion token (1 = nothing wasted)
        "rollout_rows_per_kept": stats["rollout_decoded_row_steps"] / max(stats["rollout_kept_tokens"], 1),
        "lr": lr,
    }


def add_update_metrics(metrics: dict, update: dict | None) -> None:
    """The update's own metrics (loss, kl, clipping, tokens, FLOPs), when the step made one."""
    if update is None:
        return
    metrics.update(update)
    # tokens one loss pass computes per token it needs (each prompt once per group + completions)
    metrics["loss_tokens_per_needed"] = metrics["loss_tokens_computed"] / max(metrics["loss_tokens_needed"], 1)


def add_time_metrics(metrics: dict, times: dict, memory_gb: float) -> None:
    metrics["time_rollout"] = times["rollout"]
    metrics["time_update"] = times["step"] - times["rollout"]
    if "update_flops" in metrics:  # the update's useful FLOPs per second of it (qerl.rl.flops): how near the card
        metrics["update_tflops"] = metrics["update_flops"] / max(metrics["time_update"], 1e-9) / 1e12
    metrics["time_step"] = times["step"]
    metrics["memory_gb"] = memory_gb


def step_line(metrics: dict, recompute_layers: int | None = None, wide: bool = True) -> str:
    """The console's line for one step. wide (a terminal): every figure; not wide (a log file, a pipe), one
    short line of what a run is judged by (about 90 characters), so a log read at 80 columns keeps one step
    per line; the full record is in metrics.jsonl either way."""
    m = metrics
    if not wide:
        return (f"step {m['step']} reward {m['reward']:.3f} entropy {m['entropy']:.3f} kl {m.get('kl', 0):.4f} "
                f"len {m['response_length']:.0f} {m['time_step']:.1f}s {m['memory_gb']:.1f}GB")
    update = f"(computed/needed {m.get('loss_tokens_per_needed', 0):.2f}"
    if "update_tflops" in m:
        update += f", {m['update_tflops']:.3g} TFLOP/s"
    if recompute_layers is not None and "recomputed_layers" in m:
        update += f", recompute {m['recomputed_layers']:.0f}/{recompute_layers} layers"
    return (f"step {m['step']:>4}  reward {m['reward']:.3f}  entropy {m['entropy']:.3f}  "
            f"sigma {m['aqn_sigma']:.1e}  kl {m.get('kl', 0):.4f}  clip {m.get('clip_fraction', 0):.3f}  "
            f"len {m['response_length']:.0f}  {m['tokens_per_s']:.0f} tok/s  rollout {m['time_rollout']:.1f}s "
            f"(rows/kept {m['rollout_rows_per_kept']:.2f})  update {m['time_update']:.1f}s {update})  "
            + (f"aux {m['aux_loss']:.4f}  " if "aux_loss" in m else "")
            + f"mem {m['memory_gb']:.2f} GB")
