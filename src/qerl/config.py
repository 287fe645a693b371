"""Training configuration: nested dataclasses, loaded from YAML plus `section.key=value` overrides.

Every field is documented where it is defined, grouped by purpose: what it does, its unit, and the value
of the QeRL paper's recipes (arXiv 2510.11696; "paper:", as configs/gsm8k-grpo-*.yaml and
configs/bigmath-dapo-*.yaml set them) where the paper gives one. The defaults are small enough for the
CPU demo; a paper run takes its recipe file. docs/training.md describes what one step does with them.

Unknown keys and invalid values are refused with a message naming the key; the resolved config is saved
in the run directory so a run can be reproduced and resumed. The allowed values of each choice come from
the module that interprets it (`_CHOICES`).
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .formats import FORMATS
from .models.precision import check_keep_bf16
from .nn.lora import DEFAULT_TARGETS, LoraConfig
from .quant import METHODS
from .rl.aqn import DECAYS
from .rl.losses import ALGOS
from .rl.lr_schedule import SCHEDULES
from .rl.update import OLD_LOGPROBS
from .rollout.scheduler import SCHEDULERS


class ConfigError(ValueError):
    """An invalid configuration; the message names the key."""


@dataclass
class CalibrationSection:
    """`model.calibration:` calibration text for the calibrated quantization methods (gptq, awq); rtn and
    4over6 read none."""

    source: str = "auto"  # auto | reasoning-gym | train | FILE.jsonl / .txt (sources in qerl.data.calibration)
    # sequences; null: 128 when the model is quantized on a GPU, 64 on a CPU (on SmolLM2 both give the same
    # KL and 64 keeps GPTQ under two minutes on two cores; docs/formats.md)
    samples: int | None = None
    max_tokens: int = 256  # tokens per sequence


@dataclass
class ModelSection:
    """`model:` the policy's base model, how it is stored, and where it runs."""

    # which model
    # embedded name, HF directory, GGUF file, hub id or quantized directory; paper: Qwen2.5-{3B,7B,14B,32B}-Instruct
    name: str = "smollm2-135m-instruct"
    adapter: str | None = None  # start from this PEFT adapter directory instead of a fresh LoRA
    trust_remote_code: bool = False  # let transformers run the model repository's own code
    # how the frozen base is stored
    format: str = "nvfp4"  # weight format (qerl.formats): nvfp4 | mxfp4 | nf4 | bf16 (16-bit LoRA); paper: nvfp4
    quant_method: str = "rtn"  # how codes and scales are chosen (qerl.quant): rtn | 4over6 | gptq | awq
    calibration: CalibrationSection = field(default_factory=CalibrationSection)  # for gptq / awq
    keep_bf16: list[str] = field(default_factory=list)  # module names / fnmatch patterns / last:N left 16-bit
    quantize_embeddings: bool = False  # also store the input embedding in `format` (untied models only)
    # off | update | all: keep a 16-bit copy of every 4-bit linear weight, made once and kept for the run, for
    # the loss pass (update) or the loss pass and rollouts (all). +2 bytes per weight for dense-matmul speed where
    # the 4-bit kernels lose (small models' updates; NF4, which has no fused kernel); the 4-bit weights stay what
    # the policy is (the copy is their exact dequantization) and what is saved. MoE experts keep their kernels.
    dense_weights: str = "off"
    # where it runs
    dtype: str = "auto"  # activations and unquantized tensors: auto = bf16 on a GPU, fp32 on the CPU (faster there)
    device: str = "auto"  # cpu | cuda | cuda:N; auto = cuda when available


@dataclass
class LoraSection(LoraConfig):
    """`lora:` the trainable adapters, one per targeted linear. A `qerl.nn.LoraConfig` (the type the model
    surgery takes, so the fields, defaults and checks are defined once, there), with `targets` a list as
    YAML writes it:

      r           rank; paper: 32
      alpha       the update is (alpha / r) B A; paper: 64
      dropout     dropout probability on the adapter's input, in [0, 1)
      use_rslora  scale by alpha / sqrt(r) (rank-stabilised LoRA) instead of alpha / r
      targets     leaf names of the linears that are quantized and get an adapter; default: every attention
                  and MLP projection
      experts     also LoRA on each 4-bit MoE expert's gate_up and down (Qwen3-MoE / Qwen2-MoE; same r, alpha,
                  rslora; needs dropout 0); default false: the experts stay frozen (memory: docs/training.md)
    """

    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self):
        super().__post_init__()  # LoraConfig's checks (r >= 1, dropout in [0, 1), some targets)
        self.targets = list(self.targets)


@dataclass
class DataSection:
    """`data:` the training problems and how they become prompts."""

    train: str = "reasoning-gym:basic_arithmetic"  # source (qerl.data.datasets); paper: gsm8k | bigmath
    limit: int | None = None  # use only the first N problems
    question_key: str | None = None  # column holding the question, when not a usual name
    answer_key: str | None = None  # column holding the reference answer, when not a usual name
    max_bad_fraction: float = 0.1  # refuse the source when more than this share of its rows is malformed
    # answer-format instruction after the question: gsm8k | boxed | none | literal text (qerl.data.templates);
    # paper: gsm8k (GSM8K), boxed (BigMath)
    suffix: str = "gsm8k"
    system: str | None = None  # system message of the chat template
    max_prompt_tokens: int = 256  # longer prompts are dropped, tokens; paper: 256 (GSM8K), 512 (BigMath)


@dataclass
class RolloutSection:
    """`rollout:` sampling the completions of one step."""

    # batch shape
    prompts_per_step: int = 8  # prompts per step, over all processes; paper: 128
    group_size: int = 8  # G completions per prompt, compared with each other; paper: 8 (16 for BigMath 14B / 32B)
    max_new_tokens: int = 256  # completion budget, tokens; paper: 2048 (GSM8K), 4096 (BigMath)
    # sampling distribution (log-probs are recorded and recomputed under softmax(logits / temperature))
    temperature: float = 1.0  # 0 = greedy; paper: 1.0
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]; 1 = off
    top_k: int = 0  # sample among the k most likely tokens; 0 = off
    # continuous: a finished row is refilled from the step's queue and the last rows are compacted into smaller
    # batches | static: each batch decodes until its longest row stops (the reference); same samples either way
    scheduler: str = "continuous"
    # memory
    # free the KV cache + decode graphs before each update (memory for the backward): true | false | null = auto
    # (free after the first rollout, then keep them when the run's peak plus the engine's bytes fit 70% of the
    # card: the next rollouts skip re-capturing their decode graphs; always frees under data parallel)
    release_kv_cache: bool | None = None


@dataclass
class AQNSection:
    """`aqn:` Adaptive Quantization Noise: Gaussian noise of std sigma added to the RMSNorm weights (which feed
    the quantized linears) while sampling, decaying over K equal stages of training, the first noise-free
    (qerl.rl.aqn, qerl.nn.noisy_norm)."""

    enabled: bool = True  # false = the no-AQN ablation (sigma 0 throughout); paper: true
    sigma_start: float = 1e-2  # noise std of stage 1, in the norm weights' units; paper: 1e-2
    sigma_end: float = 5e-4  # noise std of the last stage; paper: 5e-4
    num_stages: int = 10  # K; paper: 10
    # how sigma falls from sigma_start to sigma_end (qerl.rl.aqn): exponential | linear | cosine | logarithmic;
    # paper: exponential
    decay: str = "exponential"
    per_forward: bool = False  # redraw the noise before every forward (default: once per rollout batch)
    # beyond the paper: noise std sigma * |w_j| per channel, the same relative change of every norm weight (how
    # far either moves the policy depends on the model: docs/results.md, "AQN's direct effect")
    relative: bool = False
    # beyond the paper: scale sigma to hold the sampling distribution's mean token entropy (nats) at a target
    target_entropy: float | None = None  # nats per token; null = off
    controller_gain: float = 0.5  # multiplier *= exp(gain * (target - entropy) / target) after each step


@dataclass
class AlgoSection:
    """`algo:` the RL objective (qerl.rl.losses) and the DAPO options."""

    name: str = "grpo"  # grpo | dapo | dr_grpo; paper: grpo (GSM8K), dapo (BigMath)
    # the clipped objective
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low; paper: 0.2
    clip_high: float = 0.2  # the ratio is clipped above at 1 + clip_high; paper: 0.28 (DAPO's clip-higher)
    kl_beta: float = 0.0  # weight of the k3 KL to the LoRA-disabled model (0 = no reference pass); paper: 0
    scale_rewards: bool = True  # divide advantages by the group std (always off for dr_grpo)
    num_updates: int = 1  # mu: optimizer steps per rollout batch
    # the noisy sampler against the noise-free learner (docs/training.md, "Which log-probs are π_old")
    old_logprobs: str = "recompute"  # recompute (the loss policy, no noise) | sampling (the noisy sampler's)
    tis_cap: float | None = 2.0  # truncated importance sampling cap, >= 1; null = off
    # DAPO (arXiv 2503.14476); paper, BigMath: dynamic_sampling, max_refills 4, overlong_filter, overlong_buffer 512
    dynamic_sampling: bool = False  # keep only groups with mixed rewards, sample more prompts to refill
    max_refills: int = 4  # at most this many further prompt batches per step for dynamic sampling
    overlong_filter: bool = False  # truncated completions are masked out of the loss
    # soft overlong punishment L_cache, tokens: the reward falls linearly to -1 over the last this many tokens of
    # rollout.max_new_tokens (0 = off)
    overlong_buffer: int = 0


@dataclass
class OptimSection:
    """`optim:` AdamW on the LoRA parameters."""

    lr: float = 1e-5  # peak learning rate; paper: 1e-5
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    warmup_steps: int = 0  # linear warmup, steps
    schedule: str = "constant"  # after the warmup: constant | cosine (to 0 at the last step)
    max_grad_norm: float = 1.0  # clip the LoRA gradient's global L2 norm; paper: 1.0
    # loss passes without padding: micro-batches cut by tokens, each group's prompt forwarded once (docs/training.md)
    packing: bool = True
    # tokens per packed forward / backward (prompts once per micro-batch + completion tokens): memory vs speed;
    # with checkpointing ~0.4 MB a token at 7B, ~1.6 MB at 72B (the gradient is the whole batch's either way).
    # null: by model size (`qerl.rl.packing.token_budget`): 16384 up to ~1.5B, 15360 at 7B, 8192 from 14B up
    max_tokens_per_micro_batch: int | None = None
    micro_batch_size: int = 8  # packing off: padded sequences per forward / backward (memory vs speed)
    gradient_checkpointing: bool = True  # recompute each decoder layer in the backward (memory for time)
    # the backward through NVFP4 weights never dequantizes a whole weight into a 16-bit temporary (its largest
    # N x K copy: 0.27 GB at 7B, 0.97 GB at 72B); sm_90 only, slower from ~512 rows a micro-batch (memory for time)
    grad_input_no_temporary: bool = False
    max_bad_steps: int = 5  # abort after this many non-finite steps in a row


@dataclass
class MoESection:
    """`moe:` mixture-of-experts models only (Qwen3-MoE, Qwen2-MoE): the router, which picks each token's experts.
    The experts themselves are frozen 4-bit stacks. Both keys are off by default: RL post-training starts from
    a router the pretraining already balanced, and nudging routing changes the policy in ways the clipped
    objective does not see (docs/training.md, "Mixture-of-experts router")."""

    # train the routers (`mlp.gate`; Qwen2-MoE also `mlp.shared_expert_gate`) beside the LoRA adapters: fp32
    # master weights in the optimizer, routing computed in fp32, saved in the adapter (PEFT modules_to_save)
    train_router: bool = False
    # weight of the load-balancing auxiliary loss (Switch Transformer; transformers' router_aux_loss_coef,
    # 0.001 in the Qwen MoE configs) added to the RL loss, over the forward's real tokens; 0 = off
    aux_loss_coef: float = 0.0


@dataclass
class TrainConfig:
    """The whole run: one section per part of the loop, then rewards, length and outputs."""

    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    aqn: AQNSection = field(default_factory=AQNSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    optim: OptimSection = field(default_factory=OptimSection)
    moe: MoESection = field(default_factory=MoESection)
    # rewards
    rewards: list[str] = field(default_factory=lambda: ["math"])  # built-in names or package.module:function
    reward_weights: list[float] | None = None  # one per reward, summed; null = all 1
    reward_timeout_s: float = 10.0  # per reward function and batch, seconds; past it the rows are unscored (counted)
    # stop the run (a checkpoint is written first) after this many steps in a row in which one reward function
    # failed on every row (raised, timed out or returned no valid number): its weight has silently become zero
    max_reward_failure_steps: int = 3
    # length and randomness
    steps: int = 20  # training steps (one rollout batch each); paper: 200 (GSM8K), 500 (BigMath)
    seed: int = 0  # data order, LoRA initialisation, sampling and AQN noise
    # outputs
    output_dir: str = "runs/qerl"  # the run directory (config, metrics, checkpoints, adapter)
    save_every: int = 0  # checkpoint every N steps; 0 = only at the end
    keep_last: int = 2  # step checkpoints kept (0 = all)
    keep_best: bool = False  # also keep checkpoints/best: the highest mean reward since the previous save
    tensorboard: bool = True  # also log to <output_dir>/tensorboard (when tensorboard is installed)
    plots: bool = True  # write reward / entropy / sigma / length plots at the end


DENSE_WEIGHTS = ("off", "update", "all")

# The allowed values of each choice, from the module that interprets it.
_CHOICES = {
    "model.format": tuple(FORMATS),
    "model.quant_method": METHODS,
    "model.dense_weights": DENSE_WEIGHTS,
    "aqn.decay": DECAYS,
    "rollout.scheduler": SCHEDULERS,
    "algo.name": ALGOS,
    "algo.old_logprobs": OLD_LOGPROBS,
    "optim.schedule": SCHEDULES,
}
_POSITIVE = ("rollout.prompts_per_step", "rollout.max_new_tokens", "algo.num_updates",
             "optim.micro_batch_size", "optim.max_tokens_per_micro_batch", "optim.lr", "steps",
             "data.max_prompt_tokens", "reward_timeout_s",
             "aqn.num_stages", "optim.max_bad_steps", "max_reward_failure_steps", "model.calibration.samples",
             "model.calibration.max_tokens")
_OPTIONAL = ("model.calibration.samples", "optim.max_tokens_per_micro_batch")  # null means "choose for me" (documented at the field)
_NON_NEGATIVE = ("aqn.sigma_start", "aqn.sigma_end", "algo.kl_beta", "algo.clip_low", "algo.clip_high",
                 "rollout.temperature", "rollout.top_k", "optim.weight_decay", "optim.warmup_steps",
                 "optim.max_grad_norm", "algo.max_refills", "algo.overlong_buffer", "save_every", "keep_last",
                 "moe.aux_loss_coef")


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
        raise ConfigError(f"rollout.group_size must be >= 2 (group advantages need a comparison), got {cfg.rollout.group_size}")
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
    if cfg.model.dense_weights != "off" and cfg.model.format == "bf16":
        raise ConfigError("model.dense_weights only makes sense with a 4-bit model.format (bf16 weights are dense)")
    if not cfg.moe.aux_loss_coef < float("inf"):  # nan / inf: the >= 0 check above lets inf through
        raise ConfigError(f"moe.aux_loss_coef must be a finite number >= 0, got {cfg.moe.aux_loss_coef}")
    return cfg


def _coerce(value, tp, key: str):
    """Check / convert a YAML value to the annotated type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
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
