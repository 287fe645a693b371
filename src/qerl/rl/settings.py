"""The training loop's settings objects, each built once from the run's TrainConfig.

The pieces of the loop (collect, update, losses, aqn, lr_schedule) take small frozen settings and know
nothing of the config file; this module is the one place that maps config keys onto them.
"""

from typing import Callable

from ..config import TrainConfig
from ..rollout import SamplingParams
from .aqn import AQNSchedule, EntropyController
from .collect import CollectSettings
from .losses import LossSettings
from .lr_schedule import lr_factor
from .packing import token_budget
from .update import UpdateSettings


def collect_settings(cfg: TrainConfig, world: int = 1) -> CollectSettings:
    """Sampling and selection of one process's share of a step (`world` processes split the prompts)."""
    algo = cfg.algo
    return CollectSettings(
        group_size=cfg.rollout.group_size, prompts_per_step=cfg.rollout.prompts_per_step // world,
        max_new_tokens=cfg.rollout.max_new_tokens,
        sampling=SamplingParams(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p),
        aqn_per_forward=cfg.aqn.per_forward,
        aqn_relative=cfg.aqn.relative,
        scale_rewards=algo.scale_rewards and algo.name != "dr_grpo",  # Dr. GRPO drops the std division
        dynamic_sampling=algo.dynamic_sampling, max_refills=algo.max_refills,
        overlong_filter=algo.overlong_filter, overlong_buffer=algo.overlong_buffer)


def loss_settings(cfg: TrainConfig) -> LossSettings:
    algo = cfg.algo
    return LossSettings(algo.name, algo.clip_low, algo.clip_high, algo.kl_beta, cfg.rollout.max_new_tokens)


def update_settings(cfg: TrainConfig, model_config=None) -> UpdateSettings:
    """model_config: the policy's HF config, which sizes the packed micro-batches when
    optim.max_tokens_per_micro_batch is null (`token_budget`)."""
    tokens = cfg.optim.max_tokens_per_micro_batch
    if tokens is None:
        tokens = token_budget(model_config) if model_config is not None else UpdateSettings.max_tokens_per_micro_batch
    return UpdateSettings(
        loss=loss_settings(cfg), num_updates=cfg.algo.num_updates, packing=cfg.optim.packing,
        packed_attention=cfg.optim.packed_attention,
        max_tokens_per_micro_batch=tokens, micro_batch_size=cfg.optim.micro_batch_size,
        max_grad_norm=cfg.optim.max_grad_norm, temperature=cfg.rollout.temperature,
        old_logprobs=cfg.algo.old_logprobs, tis_cap=cfg.algo.tis_cap, aux_loss_coef=cfg.moe.aux_loss_coef)


def aqn_schedule(cfg: TrainConfig) -> AQNSchedule:
    a = cfg.aqn
    return AQNSchedule(a.num_stages, a.sigma_start, a.sigma_end, a.decay, a.enabled)


def entropy_controller(cfg: TrainConfig) -> EntropyController | None:
    """The sigma multiplier that holds aqn.target_entropy, or None when no target is set."""
    a = cfg.aqn
    return EntropyController(a.target_entropy, a.controller_gain) if a.target_entropy is not None else None


def lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """step -> factor of optim.lr, for torch.optim.lr_scheduler.LambdaLR."""
    return lr_factor(cfg.optim.schedule, cfg.optim.warmup_steps, cfg.steps)
