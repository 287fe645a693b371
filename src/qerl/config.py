"""Training configuration: nested dataclasses, loaded from YAML plus `section.key=value` overrides.

Unknown keys and invalid values are refused with a message naming the key; the resolved config is saved
in the run directory so a run can be reproduced and resumed.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .models.precision import check_keep_bf16
from .nn.lora import DEFAULT_TARGETS


class ConfigError(ValueError):
    """An invalid configuration; the message names the key."""


@dataclass
class CalibrationSection:
    """Calibration text for the calibrated quantization methods (gptq, awq); rtn and 4over6 need none."""
    source: str = "auto"  # auto (see qerl.data.calibration) | reasoning-gym | train | FILE.jsonl/.txt
    samples: int = 128  # sequences
    max_tokens: int = 256  # tokens per sequence


@dataclass
class ModelSection:
    name: str = "smollm2-135m-instruct"  # embedded name, HF dir, GGUF, hub id or quantized dir
    format: str = "nvfp4"  # nvfp4 | mxfp4 | nf4 | bf16 (the 16-bit LoRA baseline)
    quant_method: str = "rtn"  # rtn | 4over6 | gptq | awq: how codes and scales are chosen (qerl.quant)
    keep_bf16: list[str] = field(default_factory=list)  # module names / fnmatch patterns left in 16 bits
    calibration: CalibrationSection = field(default_factory=CalibrationSection)
    dtype: str = "auto"  # activations / unquantized tensors: auto = bf16 on a GPU, fp32 on the CPU (faster there)
    device: str = "auto"  # auto = cuda when available
    adapter: str | None = None  # start from this PEFT adapter
    trust_remote_code: bool = False
    quantize_embeddings: bool = False  # also store the input embedding in `format` (untied models only)


@dataclass
class LoraSection:
    r: int = 32
    alpha: float = 64.0
    dropout: float = 0.0
    use_rslora: bool = False
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))


@dataclass
class DataSection:
    train: str = "reasoning-gym:basic_arithmetic"
    suffix: str = "gsm8k"  # prompt suffix key (qerl.data.templates) or a literal string
    system: str | None = None
    max_prompt_tokens: int = 256
    limit: int | None = None
    question_key: str | None = None
    answer_key: str | None = None


@dataclass
class RolloutSection:
    prompts_per_step: int = 8
    group_size: int = 8  # G completions per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    release_kv_cache: bool = True  # free the KV cache + decode graphs before the update (memory for the backward)


@dataclass
class AQNSection:
    enabled: bool = True
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    num_stages: int = 10
    decay: str = "exponential"  # exponential | linear | cosine | logarithmic
    per_forward: bool = False  # redraw noise before every forward (default: once per rollout batch)
    target_entropy: float | None = None  # beyond the paper: scale sigma to hold this mean token entropy
    controller_gain: float = 0.5


@dataclass
class AlgoSection:
    name: str = "grpo"  # grpo | dapo | dr_grpo
    kl_beta: float = 0.0  # GRPO's beta for k3 KL to the LoRA-disabled reference (0 = no reference pass)
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO: 0.28
    num_updates: int = 1  # mu: policy updates per rollout batch
    old_logprobs: str = "recompute"  # recompute (loss policy, no noise) | sampling (the noisy sampler's)
    tis_cap: float | None = 2.0  # truncated importance sampling cap for sampler/learner mismatch; null = off
    scale_rewards: bool = True  # divide advantages by the group std (off for Dr. GRPO)
    dynamic_sampling: bool = False  # DAPO: keep only groups with mixed rewards, sample more to refill
    max_refills: int = 4
    overlong_filter: bool = False  # DAPO: truncated completions are masked out of the loss
    overlong_buffer: int = 0  # DAPO soft overlong punishment L_cache (0 = off)


@dataclass
class OptimSection:
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8  # sequences per forward/backward
    gradient_checkpointing: bool = True
    max_bad_steps: int = 5  # abort after this many non-finite steps in a row


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    aqn: AQNSection = field(default_factory=AQNSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    optim: OptimSection = field(default_factory=OptimSection)
    rewards: list[str] = field(default_factory=lambda: ["math"])
    reward_weights: list[float] | None = None
    reward_timeout_s: float = 10.0
    steps: int = 20
    seed: int = 0
    output_dir: str = "runs/qerl"
    save_every: int = 0  # 0 = only at the end
    keep_last: int = 2
    keep_best: bool = False  # also keep checkpoints/best: the highest mean reward since the previous save
    tensorboard: bool = True
    plots: bool = True


_CHOICES = {
    "model.format": ("nvfp4", "mxfp4", "nf4", "bf16"),
    "model.quant_method": ("rtn", "4over6", "gptq", "awq"),
    "aqn.decay": ("exponential", "linear", "cosine", "logarithmic"),
    "algo.name": ("grpo", "dapo", "dr_grpo"),
    "algo.old_logprobs": ("recompute", "sampling"),
    "optim.schedule": ("constant", "cosine"),
}
_POSITIVE = ("lora.r", "rollout.prompts_per_step", "rollout.max_new_tokens", "algo.num_updates",
             "optim.micro_batch_size", "optim.lr", "steps", "data.max_prompt_tokens", "reward_timeout_s",
             "aqn.num_stages", "optim.max_bad_steps", "model.calibration.samples",
             "model.calibration.max_tokens")
_NON_NEGATIVE = ("aqn.sigma_start", "aqn.sigma_end", "algo.kl_beta", "algo.clip_low", "algo.clip_high",
                 "rollout.temperature", "rollout.top_k", "optim.weight_decay", "optim.warmup_steps",
                 "optim.max_grad_norm", "algo.max_refills", "algo.overlong_buffer", "save_every", "keep_last")


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate(cfg: TrainConfig) -> TrainConfig:
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is not one of {choices}")
    for key in _POSITIVE:
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
    if not 0 <= cfg.lora.dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {cfg.lora.dropout}")
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
    return cls(**kwargs)


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
