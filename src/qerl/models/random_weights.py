"""Random weights as one more model source (vLLM's "dummy" load format): `random:SHAPE[,layers=N]` names a model
shape of `qerl.models.shapes` with random values, for benchmarks, whose speed does not depend on the values.

    random:qwen2.5-7b            Qwen2.5 dense sizes: qwen2.5-1.5b, -3b, -7b, -14b, -32b, -72b
    random:smollm2-135m          the embedded default model's shape
    random:qwen3-30b-a3b         mixtures of experts: qwen3-30b-a3b, gpt-oss-20b
    random:qwen2.5-72b,layers=2  fewer decoder layers (smoke tests)

The model is built one decoder layer at a time on the device (meta skeleton, then each layer materialised,
initialised and quantized), so a 72B NVFP4 model never exists in 16 bits. Every tensor is random: matrices
N(0, 0.02), norm weights 1, biases 0, and LoRA B N(0, 1e-3) (a trained-looking adapter; B = 0 would be as fast),
all from one generator seeded with `seed`, so every rank of a data-parallel run builds the same model.
"""

import re
from contextlib import contextmanager

import torch

from .quantization import Quantization
from .shapes import MOE_SHAPES, QWEN25, SMOLLM2_135M, moe_config, qwen25_config

PREFIX = "random:"
_NAME = re.compile(r"^random:(?P<shape>[a-z0-9.\-]+)(?:,layers=(?P<layers>[1-9][0-9]*))?$")


def is_random(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def shape_names() -> list[str]:
    return [f"qwen2.5-{s}" for s in QWEN25] + ["smollm2-135m", *MOE_SHAPES]


def random_name(shape: str, layers: int | None = None) -> str:
    """The source name of a shape (a `QWEN25` size such as "7b" counts as qwen2.5-7b)."""
    if shape in QWEN25:
        shape = f"qwen2.5-{shape}"
    return PREFIX + shape + (f",layers={layers}" if layers else "")


def random_config(name: str):
    """The Hugging Face config of a `random:` source name; ValueError naming the shapes for an unknown one."""
    m = _NAME.match(name)
    shape = m["shape"] if m else None
    if shape not in shape_names():
        raise ValueError(f"{name!r}: random weights take random:SHAPE[,layers=N], SHAPE one of "
                         f"{', '.join(shape_names())}")
    layers = int(m["layers"]) if m["layers"] else None
    if shape in MOE_SHAPES:
        return moe_config(shape, layers)
    if shape == "smollm2-135m":
        from transformers import LlamaConfig

        return LlamaConfig(**{**SMOLLM2_135M, **({"num_hidden_layers": layers} if layers else {})})
    return qwen25_config(shape.removeprefix("qwen2.5-"), layers)


@torch.no_grad()
def init_random_(module: torch.nn.Module, generator: torch.Generator) -> None:
    """HF-like random init in place: biases 0, other vectors (norm weights) 1, matrices N(0, 0.02)."""
    for name, p in module.named_parameters():
        if p.ndim == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            p.normal_(0.0, 0.02, generator=generator)


class RandomLayers:
    """Random weights of `config` as a layer source for `stream.build_from`: while `opened`, `fill(module, prefix)`
    materialises a module on `device` and initialises it (`init_random_`) from one generator seeded with `seed`;
    `finish` draws LoRA B from it too. No tokenizer."""

    tokenizer = None

    def __init__(self, config, device, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        self.config, self.device, self.dtype, self.seed = config, torch.device(device), dtype, seed

    @contextmanager
    def opened(self):
        torch.manual_seed(self.seed)  # LoRA A is drawn from the default generators: identical on every rank
        self.generator = torch.Generator(self.device).manual_seed(self.seed)

        def fill(module, prefix):
            module.to_empty(device=self.device)
            init_random_(module, self.generator)

        yield fill

    def finish(self, model):
        """(model, None): LoRA B N(0, 1e-3) (a trained-looking adapter), no KV cache in the HF forward."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 1e-3, generator=self.generator)
        model.config.use_cache = False
        return model, None


def random_policy(config, q: Quantization, device, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                  show_progress: bool = False):
    """A random-weight causal LM for `config` quantized as `q` (`Quantization`; format "bf16" = the 16-bit LoRA
    baseline through the same layer), built one decoder layer at a time on `device` (`RandomLayers`,
    `stream.build_from`); eval mode, no KV cache in the HF forward."""
    from .stream import build_from

    return build_from(RandomLayers(config, device, dtype=dtype, seed=seed), q, show_progress=show_progress)[0]


def random_calibration(config, samples: int, max_tokens: int, seed: int = 0) -> torch.Tensor:
    """Calibration token ids int64 [samples, max_tokens] for a random-weight model (it has no tokenizer)."""
    return torch.randint(0, config.vocab_size, (samples, max_tokens), generator=torch.Generator().manual_seed(seed))
