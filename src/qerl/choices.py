"""The allowed values of the training config's choices, each defined once, in a module that imports nothing of
qerl's.

`qerl.config` validates a run's config against these tuples, and the modules that interpret each choice
import (and re-export) them from here, so the config stays a leaf module: loading or documenting a config
never imports torch, the kernels or the training loop.
"""

from typing import Iterable

# model.format: the weight formats (the keys of `qerl.formats.FORMATS`, in that order)
FORMAT_NAMES = ("nvfp4", "mxfp4", "nf4", "fp8", "bf16")
# model.quant_method: the quantization methods (`qerl.quant`)
METHODS = ("rtn", "4over6", "gptq", "awq")
# model.dense_weights: where 16-bit copies of the 4-bit weights are used
DENSE_WEIGHTS = ("off", "update", "all")
# model.compute: the products of 4-bit weights (`qerl.kernels.dispatch`)
COMPUTE = ("bf16", "fp8")
# aqn.decay: how AQN's sigma falls over the stages (`qerl.rl.aqn`)
DECAYS = ("exponential", "linear", "cosine", "logarithmic")
# algo.name: the RL objectives (`qerl.rl.losses`)
ALGOS = ("grpo", "dapo", "dr_grpo")
# algo.old_logprobs: which log-probs play pi_old (`qerl.rl.update`)
OLD_LOGPROBS = ("recompute", "sampling")
# optim.gradient_checkpointing: which decoder layers recompute in the backward (`qerl.rl.recompute`)
GRADIENT_CHECKPOINTING = ("auto", True, False)
# optim.schedule: the learning-rate schedules after the warmup (`qerl.rl.lr_schedule`)
SCHEDULES = ("constant", "cosine")
# optim.packed_attention: the attention of the packed loss passes (`qerl.nn.packed_attention`)
PACKED_ATTENTION = ("sdpa", "flex")
# rollout.scheduler: the rollout engine's schedulers (`qerl.rollout.scheduler`)
SCHEDULERS = ("continuous", "static")

# lora.init: how a fresh adapter starts (`qerl.models.lora_init`)
LORA_INITS = ("zero", "loftq", "eora")

# model.keep_bf16: the prefix of a `last:N` entry (the syntax is described in `qerl.models.precision`)
KEEP_BF16_LAST = "last:"


def keep_bf16_last_count(spec: str) -> int:
    """N of a `last:N` entry; ValueError unless N is a positive integer."""
    n = spec[len(KEEP_BF16_LAST):]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"keep_bf16 entry {spec!r}: write last:N with N >= 1 decoder layers, e.g. last:2")
    return int(n)


def check_keep_bf16(specs: Iterable[str]) -> list[str]:
    """The entries as a list, after a syntax check that needs no model (e.g. for config validation).

    ValueError for a non-string or empty entry, or a `last:N` whose N is not a positive integer."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"keep_bf16 entries are module names or patterns, got {spec!r}")
        if spec.startswith(KEEP_BF16_LAST):
            keep_bf16_last_count(spec)
    return specs
