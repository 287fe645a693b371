"""Training configuration: nested dataclasses, loaded from YAML plus `section.key=value` overrides.

Every field is documented where it is defined, in its metadata's "help", grouped by purpose: what it does,
its unit, and the value of the QeRL paper's recipes (arXiv 2510.11696; "paper:", as
configs/gsm8k-grpo-*.yaml and configs/bigmath-dapo-*.yaml set them) where the paper gives one. The defaults
are small enough for the CPU demo; a paper run takes its recipe file. docs/training.md describes what one
step does with them. `config_help()` prints every key (`qerl train --help-config`) and `config_markdown()`
writes docs/config.md (`python -m qerl.config --markdown > docs/config.md`).

Unknown keys and invalid values are refused with a message naming the key; the resolved config is saved
in the run directory so a run can be reproduced and resumed. The allowed values of each choice (`_CHOICES`)
are defined once in `qerl.choices`, which the modules that interpret them import as well: this module is a
leaf, importing nothing of qerl's but `qerl.choices` and `qerl.lora_config` (no torch).
"""

import dataclasses
import math
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .choices import (ALGOS, COMPUTE, DECAYS, DENSE_WEIGHTS, FORMAT_NAMES, GRADIENT_CHECKPOINTING, LORA_INITS, METHODS,
                      OLD_LOGPROBS, PACKED_ATTENTION, SCHEDULERS, SCHEDULES, check_keep_bf16)
from .lora_config import DEFAULT_TARGETS, LoraConfig


class ConfigError(ValueError):
    """An invalid configuration; the message names the key."""


@dataclass
class CalibrationSection:
    """`model.calibration:` calibration text for the calibrated quantization methods (gptq, awq); rtn and
    4over6 read none."""

    source: str = field(default="auto", metadata={
        "help": "auto | reasoning-gym | train | FILE.jsonl / .txt (sources in qerl.data.calibration)"})
    samples: int | None = field(default=None, metadata={
        "help": "sequences; null: 128 when the model is quantized on a GPU, 64 on a CPU (on SmolLM2 both give "
                "the same KL and 64 keeps GPTQ under two minutes on two cores; docs/formats.md)"})
    max_tokens: int = field(default=256, metadata={"help": "tokens per sequence"})


@dataclass
class ModelSection:
    """`model:` the policy's base model, how it is stored, and where it runs."""

    # which model
    name: str = field(default="smollm2-135m-instruct", metadata={
        "help": "embedded name, HF directory, GGUF file, hub id or quantized directory; "
                "paper: Qwen2.5-{3B,7B,14B,32B}-Instruct"})
    adapter: str | None = field(default=None, metadata={
        "help": "start from this PEFT adapter directory instead of a fresh LoRA"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "let transformers run the model repository's own code"})
    # how the frozen base is stored
    format: str = field(default="nvfp4", metadata={
        "help": "weight format (qerl.formats); bf16 = 16-bit LoRA; fp8 = e4m3 with per-channel scales, W8A8 on "
                "FP8 tensor cores (sm_89+), else dequantized (docs/formats.md); paper: nvfp4"})
    quant_method: str = field(default="rtn", metadata={
        "help": "how codes and scales are chosen (qerl.quant)"})
    calibration: CalibrationSection = field(default_factory=CalibrationSection, metadata={
        "help": "calibration text for gptq / awq"})
    keep_bf16: list[str] = field(default_factory=list, metadata={
        "help": "module names / fnmatch patterns / last:N left 16-bit (syntax: qerl.models.precision)"})
    quantize_embeddings: bool = field(default=False, metadata={
        "help": "also store the input embedding in `format` (untied models only)"})
    dense_weights: str = field(default="off", metadata={
        "help": "keep a 16-bit copy of every 4-bit linear weight, made once and kept for the run, for the loss "
                "pass (update) or the loss pass and rollouts (all; on a GPU a decode step reads the copies from "
                "kernels/tuning's dense_min_m rows, 128, and the NVFP4 / MXFP4 kernels below, where they win). +2 "
                "bytes per weight for dense-matmul speed where the 4-bit kernels lose (small models' updates, wide "
                "decode batches; NF4, which has no fused kernel); the 4-bit "
                "weights stay what the policy is (the copy is their exact dequantization) and what is saved. "
                "MoE experts keep their kernels."})
    compute: str = field(default="bf16", metadata={
        "help": "products of the nvfp4 / mxfp4 weights: bf16 (16-bit activations) or fp8 (W4A8: weights decoded to "
                "e4m3, activations rounded to e4m3 per token; FP8 tensor cores on sm_89+, the same numerics emulated "
                "in fp32 elsewhere; one routing for the rollouts and the loss pass, which on a GPU keeps the decode's "
                "small products (under 512 rows) on 16-bit activations; input gradients 16-bit; docs/formats.md)"})
    # where it runs
    dtype: str = field(default="auto", metadata={
        "help": "activations and unquantized tensors: auto = bf16 on a GPU, fp32 on the CPU (faster there)"})
    device: str = field(default="auto", metadata={"help": "cpu | cuda | cuda:N; auto = cuda when available"})


@dataclass
class LoraSection(LoraConfig):
    """`lora:` the trainable adapters, one per targeted linear. A `qerl.nn.LoraConfig` (the type the model
    surgery takes, so the fields, defaults, help and checks are defined once, in `qerl.lora_config`), with
    `targets` a list as YAML writes it."""

    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS),
                               metadata=LoraConfig.__dataclass_fields__["targets"].metadata)

    def __post_init__(self):
        super().__post_init__()  # LoraConfig's checks (r >= 1, dropout in [0, 1), some targets)
        self.targets = list(self.targets)


@dataclass
class DataSection:
    """`data:` the training problems and how they become prompts."""

    train: str = field(default="reasoning-gym:basic_arithmetic", metadata={
        "help": "source (qerl.data.datasets); paper: gsm8k | bigmath"})
    limit: int | None = field(default=None, metadata={"help": "use only the first N problems"})
    question_key: str | None = field(default=None, metadata={
        "help": "column holding the question, when not a usual name"})
    answer_key: str | None = field(default=None, metadata={
        "help": "column holding the reference answer, when not a usual name"})
    max_bad_fraction: float = field(default=0.1, metadata={
        "help": "refuse the source when more than this share of its rows is malformed"})
    suffix: str = field(default="gsm8k", metadata={
        "help": "answer-format instruction after the question: gsm8k | boxed | none, or text:LITERAL "
                "TEXT (anything else is refused; qerl.data.templates); paper: gsm8k (GSM8K), boxed (BigMath)"})
    system: str | None = field(default=None, metadata={"help": "system message of the chat template"})
    max_prompt_tokens: int = field(default=256, metadata={
        "help": "longer prompts are dropped, tokens; paper: 256 (GSM8K), 512 (BigMath)"})


@dataclass
class RolloutSection:
    """`rollout:` sampling the completions of one step."""

    # batch shape
    prompts_per_step: int = field(default=8, metadata={"help": "prompts per step, over all processes; paper: 128"})
    group_size: int = field(default=8, metadata={
        "help": "G completions per prompt, compared with each other; paper: 8 (16 for BigMath 14B / 32B)"})
    max_new_tokens: int = field(default=256, metadata={
        "help": "completion budget, tokens; paper: 2048 (GSM8K), 4096 (BigMath)"})
    # sampling distribution
    temperature: float = field(default=1.0, metadata={
        "help": "0 = greedy; log-probs are recorded and recomputed under softmax(logits / temperature); "
                "paper: 1.0"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass, in (0, 1]; 1 = off"})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens; 0 = off"})
    scheduler: str = field(default="continuous", metadata={
        "help": "continuous: a finished row is refilled from the step's queue and the last rows are compacted "
                "into smaller batches | static: each batch decodes until its longest row stops (the "
                "reference); same samples either way"})
    # memory
    release_kv_cache: bool | None = field(default=None, metadata={
        "help": "free the KV cache + decode graphs before each update (memory for the backward): true | false "
                "| null = auto (free after the first rollout, then keep them when the run's peak plus the "
                "engine's bytes fit 70% of the card: the next rollouts skip re-capturing their decode graphs; "
                "always frees under data parallel)"})


@dataclass
class AQNSection:
    """`aqn:` Adaptive Quantization Noise: Gaussian noise of std sigma added to the RMSNorm weights (which feed
    the quantized linears) while sampling, decaying over K equal stages of training, the first noise-free
    (qerl.rl.aqn, qerl.nn.noisy_norm)."""

    enabled: bool = field(default=True, metadata={
        "help": "false = the no-AQN ablation (sigma 0 throughout); paper: true"})
    sigma_start: float = field(default=1e-2, metadata={
        "help": "noise std of stage 1, in the norm weights' units; paper: 1e-2"})
    sigma_end: float = field(default=5e-4, metadata={"help": "noise std of the last stage; paper: 5e-4"})
    num_stages: int = field(default=10, metadata={"help": "K; paper: 10"})
    decay: str = field(default="exponential", metadata={
        "help": "how sigma falls from sigma_start to sigma_end (qerl.rl.aqn); paper: exponential"})
    per_forward: bool = field(default=False, metadata={
        "help": "redraw the noise before every forward (default: once per rollout batch)"})
    relative: bool = field(default=False, metadata={
        "help": "beyond the paper: noise std sigma * |w_j| per channel, the same relative change of every norm "
                "weight (how far either moves the policy depends on the model: docs/results.md, \"AQN's "
                "direct effect\")"})
    target_entropy: float | None = field(default=None, metadata={
        "help": "beyond the paper: scale sigma to hold the sampling distribution's mean token entropy at this "
                "target, nats per token; null = off"})
    controller_gain: float = field(default=0.5, metadata={
        "help": "multiplier *= exp(gain * (target - entropy) / target) after each step (aqn.target_entropy)"})


@dataclass
class AlgoSection:
    """`algo:` the RL objective (qerl.rl.losses) and the DAPO options."""

    name: str = field(default="grpo", metadata={"help": "the objective; paper: grpo (GSM8K), dapo (BigMath)"})
    # the clipped objective
    clip_low: float = field(default=0.2, metadata={
        "help": "the ratio is clipped below at 1 - clip_low; paper: 0.2"})
    clip_high: float = field(default=0.2, metadata={
        "help": "the ratio is clipped above at 1 + clip_high; paper: 0.28 (DAPO's clip-higher)"})
    kl_beta: float = field(default=0.0, metadata={
        "help": "weight of the k3 KL to the LoRA-disabled model (0 = no reference pass); paper: 0"})
    scale_rewards: bool = field(default=True, metadata={
        "help": "divide advantages by the group std (always off for dr_grpo)"})
    num_updates: int = field(default=1, metadata={"help": "mu: optimizer steps per rollout batch"})
    # the noisy sampler against the noise-free learner
    old_logprobs: str = field(default="recompute", metadata={
        "help": "which log-probs are pi_old: recompute (the loss policy, no noise) | sampling (the noisy "
                "sampler's); docs/training.md, \"Which log-probs are π_old\""})
    tis_cap: float | None = field(default=2.0, metadata={
        "help": "truncated importance sampling cap, >= 1; null = off"})
    # DAPO (arXiv 2503.14476)
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "DAPO: keep only groups with mixed rewards, sample more prompts to refill; paper, BigMath: true"})
    max_refills: int = field(default=4, metadata={
        "help": "at most this many further prompt batches per step for dynamic sampling; paper, BigMath: 4"})
    overlong_filter: bool = field(default=False, metadata={
        "help": "DAPO: truncated completions are masked out of the loss; paper, BigMath: true"})
    overlong_buffer: int = field(default=0, metadata={
        "help": "DAPO's soft overlong punishment L_cache, tokens: the reward falls linearly to -1 over the last "
                "this many tokens of rollout.max_new_tokens (0 = off); paper, BigMath: 512"})


@dataclass
class OptimSection:
    """`optim:` AdamW on the LoRA parameters."""

    lr: float = field(default=1e-5, metadata={"help": "peak learning rate; paper: 1e-5"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW's decoupled weight decay"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warmup, steps"})
    schedule: str = field(default="constant", metadata={
        "help": "after the warmup: constant, or cosine (to 0 at the last step)"})
    max_grad_norm: float = field(default=1.0, metadata={
        "help": "clip the LoRA gradient's global L2 norm; paper: 1.0"})
    packing: bool = field(default=True, metadata={
        "help": "loss passes without padding: micro-batches cut by tokens, each group's prompt forwarded once "
                "(docs/training.md)"})
    packed_attention: str = field(default="sdpa", metadata={
        "help": "the packed passes' attention: sdpa, each segment gathered into padded views for SDPA (the "
                "reference), or flex, the stream attended in place by FlexAttention with a block mask (CUDA; not "
                "for attention sinks; a shorter update, a longer first step while its kernels compile: "
                "docs/training.md)"})
    max_tokens_per_micro_batch: int | None = field(default=None, metadata={
        "help": "tokens per packed forward / backward (prompts once per micro-batch + completion tokens): "
                "memory vs speed; with checkpointing ~0.4 MB a token at 7B, ~1.6 MB at 72B (the gradient is the "
                "whole batch's either way). null: by model size (`qerl.rl.packing.token_budget`): 16384 up to "
                "~1.5B, 15360 at 7B, 8192 from 14B up"})
    micro_batch_size: int = field(default=8, metadata={
        "help": "packing off: padded sequences per forward / backward (memory vs speed)"})
    gradient_checkpointing: bool | str = field(default="auto", metadata={
        "help": "recompute decoder layers in the backward (memory for time): true every layer, false none, "
                "auto as few as the GPU's memory allows after the rollout engine's and the micro-batch's "
                "(every layer off CUDA; `qerl.rl.recompute`, docs/training.md)"})
    grad_input_no_temporary: bool = field(default=False, metadata={
        "help": "the backward through NVFP4 weights never dequantizes a whole weight into a 16-bit temporary "
                "(its largest N x K copy: 0.27 GB at 7B, 0.97 GB at 72B); sm_90 only, slower from ~512 rows a "
                "micro-batch (memory for time)"})
    max_bad_steps: int = field(default=5, metadata={"help": "abort after this many non-finite steps in a row"})


@dataclass
class MoESection:
    """`moe:` mixture-of-experts models only (Qwen3-MoE, Qwen2-MoE): the router, which picks each token's experts.
    The experts themselves are frozen 4-bit stacks. Both keys are off by default: RL post-training starts from
    a router the pretraining already balanced, and nudging routing changes the policy in ways the clipped
    objective does not see (docs/training.md, "Mixture-of-experts router")."""

    train_router: bool = field(default=False, metadata={
        "help": "train the routers (`mlp.gate`; Qwen2-MoE also `mlp.shared_expert_gate`) beside the LoRA "
                "adapters: fp32 master weights in the optimizer, routing computed in fp32, saved in the adapter "
                "(PEFT modules_to_save)"})
    aux_loss_coef: float = field(default=0.0, metadata={
        "help": "weight of the load-balancing auxiliary loss (Switch Transformer; transformers' "
                "router_aux_loss_coef, 0.001 in the Qwen MoE configs) added to the RL loss, over the forward's "
                "real tokens; 0 = off"})


@dataclass
class TrainConfig:
    """The whole run: one section per part of the loop, then rewards, length and outputs."""

    model: ModelSection = field(default_factory=ModelSection, metadata={"help": "the policy's base model"})
    lora: LoraSection = field(default_factory=LoraSection, metadata={"help": "the trainable adapters"})
    data: DataSection = field(default_factory=DataSection, metadata={"help": "the training problems"})
    rollout: RolloutSection = field(default_factory=RolloutSection, metadata={"help": "sampling the completions"})
    aqn: AQNSection = field(default_factory=AQNSection, metadata={"help": "Adaptive Quantization Noise"})
    algo: AlgoSection = field(default_factory=AlgoSection, metadata={"help": "the RL objective"})
    optim: OptimSection = field(default_factory=OptimSection, metadata={"help": "AdamW on the LoRA parameters"})
    moe: MoESection = field(default_factory=MoESection, metadata={"help": "mixture-of-experts routers"})
    # rewards
    rewards: list[str] = field(default_factory=lambda: ["math"], metadata={
        "help": "reward functions: built-in names or package.module:function"})
    reward_weights: list[float] | None = field(default=None, metadata={
        "help": "one per reward, summed; null = all 1"})
    reward_timeout_s: float = field(default=10.0, metadata={
        "help": "per reward function and batch, seconds; past it the rows are unscored (counted)"})
    max_reward_failure_steps: int = field(default=3, metadata={
        "help": "stop the run (a checkpoint is written first) after this many steps in a row in which one reward "
                "function failed on every row (raised, timed out or returned no valid number): its weight has "
                "silently become zero"})
    # length and randomness
    steps: int = field(default=20, metadata={
        "help": "training steps (one rollout batch each); paper: 200 (GSM8K), 500 (BigMath)"})
    seed: int = field(default=0, metadata={"help": "data order, LoRA initialisation, sampling and AQN noise"})
    # outputs
    output_dir: str = field(default="runs/qerl", metadata={
        "help": "the run directory (config, metrics, checkpoints, adapter)"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps; 0 = only at the end"})
    keep_last: int = field(default=2, metadata={"help": "step checkpoints kept (0 = all)"})
    keep_best: bool = field(default=False, metadata={
        "help": "also keep checkpoints/best: the highest mean reward since the previous save"})
    tensorboard: bool = field(default=True, metadata={
        "help": "also log to <output_dir>/tensorboard (when tensorboard is installed)"})
    plots: bool = field(default=True, metadata={"help": "write reward / entropy / sigma / length plots at the end"})


# The allowed values of each choice (defined in qerl.choices, imported by the modules that interpret them).
_CHOICES = {
    "model.format": FORMAT_NAMES,
    "model.quant_method": METHODS,
    "model.dense_weights": DENSE_WEIGHTS,
    "model.compute": COMPUTE,
    "lora.init": LORA_INITS,
    "aqn.decay": DECAYS,
    "rollout.scheduler": SCHEDULERS,
    "algo.name": ALGOS,
    "algo.old_logprobs": OLD_LOGPROBS,
    "optim.gradient_checkpointing": GRADIENT_CHECKPOINTING,
    "optim.packed_attention": PACKED_ATTENTION,
    "optim.schedule": SCHEDULES,
}
_POSITIVE = ("rollout.prompts_per_step", "rollout.max_new_tokens", "algo.num_updates",
             "optim.micro_batch_size", "optim.max_tokens_per_micro_batch", "optim.lr", "steps",
             "data.max_prompt_tokens", "reward_timeout_s",
             "aqn.num_stages", "optim.max_bad_steps", "max_reward_failure_steps", "model.calibration.samples",
             "model.calibration.max_tokens", "data.limit")
# null means "choose for me" (documented at the field)
_OPTIONAL = ("model.calibration.samples", "optim.max_tokens_per_micro_batch", "data.limit")
_NON_NEGATIVE = ("aqn.sigma_start", "aqn.sigma_end", "algo.kl_beta", "algo.clip_low", "algo.clip_high",
                 "rollout.temperature", "rollout.top_k", "optim.weight_decay", "optim.warmup_steps",
                 "optim.max_grad_norm", "algo.max_refills", "algo.overlong_buffer", "save_every", "keep_last",
                 "moe.aux_loss_coef")

# Values no run means: past these the first update wrecks the adapter (AdamW moves every weight by ~lr per step).
_ABSURD = (("optim.lr", 1.0, "AdamW moves each LoRA weight by about lr per step; LoRA RL uses 1e-6 to 1e-4"),
           ("optim.weight_decay", 1.0, "AdamW shrinks each weight by lr * weight_decay per step; 0 to 0.1 is usual"),
           ("aqn.sigma_start", 1.0, "the noise is relative to RMSNorm weights of about 1; the paper starts at 1e-2"),
           ("aqn.sigma_end", 1.0, "the noise is relative to RMSNorm weights of about 1; the paper ends at 5e-4"),
           ("rollout.temperature", 10.0, "past a few the sampled tokens are close to uniform over the vocabulary"),
           ("algo.kl_beta", 10.0, "the KL penalty would outweigh every advantage; GRPO uses 0 to 0.1"),
           ("algo.clip_high", 10.0, "the ratio clip 1 + clip_high would never bind; 0.2 to 0.28 is usual"))


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate(cfg: TrainConfig) -> TrainConfig:
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is not one of {choices}")
    for key in _POSITIVE:
        if key in _OPTIONAL and _get(cfg, key) is None:
            continue
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {_get(cfg, key)}")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {_get(cfg, key)}")
    if cfg.rollout.group_size < 2:
        raise ConfigError("rollout.group_size must be >= 2 (group advantages need a comparison), "
                          f"got {cfg.rollout.group_size}")
    if cfg.lora.init == "eora" and cfg.lora.experts:
        raise ConfigError("lora.init eora: not with expert LoRA (lora.experts) yet (each expert's routed inputs are "
                          "not collected); use lora.init loftq or turn lora.experts off")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    if cfg.algo.clip_low >= 1:
        raise ConfigError(f"algo.clip_low must be < 1, got {cfg.algo.clip_low}")
    if cfg.algo.tis_cap is not None and cfg.algo.tis_cap < 1:
        raise ConfigError(f"algo.tis_cap must be >= 1 or null, got {cfg.algo.tis_cap}")
    if cfg.algo.overlong_buffer >= cfg.rollout.max_new_tokens:
        raise ConfigError("algo.overlong_buffer must be smaller than rollout.max_new_tokens")
    if cfg.aqn.target_entropy is not None and not (cfg.aqn.target_entropy > 0 and cfg.aqn.controller_gain > 0):
        raise ConfigError("aqn.target_entropy and aqn.controller_gain must be > 0")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.rewards):
        raise ConfigError(f"reward_weights has {len(cfg.reward_weights)} entries for {len(cfg.rewards)} rewards")
    if not cfg.rewards:
        raise ConfigError("rewards: at least one reward function is needed")
    try:
        check_keep_bf16(cfg.model.keep_bf16)
    except ValueError as e:
        raise ConfigError(f"model.keep_bf16: {e}") from None
    if cfg.model.keep_bf16 and cfg.model.format == "bf16":
        raise ConfigError("model.keep_bf16 only makes sense with a 4-bit model.format")
    if cfg.model.compute == "fp8" and cfg.model.format not in ("nvfp4", "mxfp4"):
        raise ConfigError(f"model.compute fp8 takes nvfp4 or mxfp4 weights (W4A8), not model.format "
                          f"{cfg.model.format}; for FP8 weights use model.format fp8")
    if cfg.model.compute == "fp8" and cfg.model.dense_weights != "off":
        raise ConfigError("model.compute fp8 multiplies the 4-bit weights decoded to e4m3: model.dense_weights "
                          "(16-bit copies) must be off")
    if cfg.model.format == "fp8" and cfg.model.quant_method != "rtn":
        raise ConfigError(f"model.format fp8: model.quant_method {cfg.model.quant_method} is not built for it; use rtn")
    if cfg.model.format in ("fp8", "bf16") and cfg.model.quantize_embeddings:
        raise ConfigError(f"model.quantize_embeddings needs a 4-bit model.format (nvfp4, mxfp4, nf4), not "
                          f"{cfg.model.format}")
    if cfg.model.dense_weights != "off" and cfg.model.format == "bf16":
        raise ConfigError("model.dense_weights only makes sense with a 4-bit model.format (bf16 weights are dense)")
    if not cfg.moe.aux_loss_coef < float("inf"):  # nan / inf: the >= 0 check above lets inf through
        raise ConfigError(f"moe.aux_loss_coef must be a finite number >= 0, got {cfg.moe.aux_loss_coef}")
    if not 0 <= cfg.seed < 2**32:  # NumPy's range: past it the run failed at start without naming the key
        raise ConfigError(f"seed must be in [0, 2**32), got {cfg.seed}")
    for key, limit, why in _ABSURD:
        if _get(cfg, key) > limit:
            raise ConfigError(f"{key} must be <= {limit:g}, got {_get(cfg, key)} ({why})")
    return cfg


def _coerce(value, tp, key: str):
    """Check / convert a YAML value to the annotated type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for tp_inner in inner[:-1]:  # the first type the value converts to (`bool | str`: true/false, else text)
            try:
                return _coerce(value, tp_inner, key)
            except ConfigError:
                pass
        return _coerce(value, inner[-1], key)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # no setting means anything at inf / nan: optim.lr=inf made NaN weights
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(prefix + u for u in unknown)}; "
                          f"valid keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, prefix + name)
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own checks (LoraSection: LoraConfig's)
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from None


def _set_dotted(data: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        data = data.setdefault(part, {})
        if not isinstance(data, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    data[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """YAML file (optional) + `a.b=value` overrides (values parsed as YAML) -> validated TrainConfig."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({e})") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return validate(_build(TrainConfig, data))


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# --- self-documentation: every key's help is its field's metadata ---------------------------------------------


def _type_name(tp) -> str:
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp).replace("typing.", "")


def _default_text(value) -> str:
    """A default as YAML writes it (null, true, [a, b])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_default_text(v) for v in value) + "]"
    return str(value)


def config_sections(cls=TrainConfig, prefix: str = "") -> list[tuple[str, type, list[dict]]]:
    """[(section name, section class, [key entries])] in definition order: "" for the top-level keys, then
    each section (nested ones, such as model.calibration, after their parent). An entry is a dict with key
    (dotted), type, default (YAML text), choices (a tuple or None) and help."""
    hints = typing.get_type_hints(cls)
    entries, nested = [], []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            nested.extend(config_sections(hints[f.name], key + "."))
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        entries.append({"key": key, "type": _type_name(hints[f.name]), "default": _default_text(default),
                        "choices": _CHOICES.get(key), "help": f.metadata.get("help", "")})
    return [(prefix.rstrip("."), cls, entries)] + nested


def _section_order(sections):
    """The sections first, the top-level keys (section "") last."""
    return [s for s in sections if s[0]] + [s for s in sections if not s[0]]


def _help_text(entry: dict) -> str:
    text = entry["help"]
    if entry["choices"]:
        text += ("" if text.endswith(".") else ".") + f" One of: {', '.join(map(_default_text, entry['choices']))}."
    return text


def _wrap(text: str, **kw) -> list[str]:
    return textwrap.wrap(text, width=110, break_on_hyphens=False, **kw)


def config_help() -> str:
    """Every config key as plain text, one entry per key: `section.key (type, default): help`."""
    lines = ["Training config keys: YAML sections (configs/*.yaml), or section.key=value overrides.", ""]
    for name, cls, entries in _section_order(config_sections()):
        doc = " ".join(inspect.getdoc(cls).split())
        lines += _wrap(doc if name else f"Top-level keys. {doc}") + [""]
        for e in entries:
            lines += _wrap(f"{e['key']} ({e['type']}, {e['default']}): {_help_text(e)}", initial_indent="  ",
                           subsequent_indent="      ")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _md_cell(text: str, code: bool = False) -> str:
    """A table cell: `|` escaped (also inside code spans, as GitHub's tables want), `<` as text outside them."""
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if code else text.replace("<", "&lt;")


MARKDOWN_COMMAND = "python -m qerl.config --markdown > docs/config.md"


def config_markdown() -> str:
    """docs/config.md: one table per section (key, type, default, help), generated from the fields' metadata."""
    intro = (f"Generated from `src/qerl/config.py` (each field's metadata) by `{MARKDOWN_COMMAND}`; do not edit "
             "by hand (tests/test_config_doc.py checks it). `qerl train --help-config` prints the same as plain "
             "text.")
    usage = ("A config is a YAML file of these sections (`configs/*.yaml`), with `section.key=value` overrides on "
             "the command line; unknown keys and invalid values are refused with a message naming the key. "
             "\"paper:\" gives the value of the QeRL paper's recipes (configs/gsm8k-grpo-*.yaml, "
             "configs/bigmath-dapo-*.yaml) where the paper gives one. What one step does with them: "
             "[training.md](training.md).")
    out = ["# Configuration reference", "", *_wrap(intro), "", *_wrap(usage), ""]
    for name, cls, entries in _section_order(config_sections()):
        doc = " ".join(inspect.getdoc(cls).split()).removeprefix(f"`{name}:` ")
        out += [f"## `{name}:`" if name else "## Top-level keys", "", *_wrap(doc), "",
                "| key | type | default | help |", "|---|---|---|---|"]
        for e in entries:
            key = e["key"][len(name) + 1:] if name else e["key"]
            cells = [f"`{key}`", _md_cell(e["type"], code=True), _md_cell(e["default"], code=True),
                     _md_cell(_help_text(e))]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m qerl.config",
                                     description="Print every training config key with its type, default and help.")
    parser.add_argument("--markdown", action="store_true", help=f"docs/config.md's text ({MARKDOWN_COMMAND})")
    print(config_markdown() if parser.parse_args().markdown else config_help(), end="")
