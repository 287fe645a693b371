"""LoRA hyper-parameters: the type the model surgery takes (`qerl.nn.LoraConfig`) and the base of the config's
`lora:` section, defined once, here, in a module that imports nothing heavy (no torch), so `qerl.config` stays
a leaf module. Each field's help is in its metadata (`qerl.config.config_help` prints it)."""

import math
from dataclasses import dataclass, field

from .choices import LORA_INITS

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    r: int = field(default=32, metadata={"help": "rank; paper: 32"})
    alpha: float = field(default=64.0, metadata={"help": "the update is (alpha / r) B A; paper: 64"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability on the adapter's input, in [0, 1)"})
    use_rslora: bool = field(default=False, metadata={
        "help": "scale by alpha / sqrt(r) (rank-stabilised LoRA) instead of alpha / r"})
    targets: tuple[str, ...] = field(default_factory=lambda: DEFAULT_TARGETS, metadata={
        "help": "leaf names of the linears that are quantized and get an adapter; default: every attention and "
                "MLP projection"})
    experts: bool = field(default=False, metadata={
        "help": "also LoRA on each 4-bit MoE expert's gate_up and down (`QuantExperts.add_lora`; Qwen3-MoE / "
                "Qwen2-MoE; same r, alpha, rslora; needs dropout 0); false: the experts stay frozen (memory: "
                "docs/training.md)"})
    init: str = field(default="zero", metadata={
        "help": "how a fresh adapter starts: zero (PEFT's: A random, B zero; the model starts as the quantized base) "
                "| loftq (B A = the rank-r truncated SVD of the quantization residual W - Q(W), base kept as "
                "quantized; expert stacks too) | eora (the residual's SVD in the eigenspace of each layer's input "
                "activations "
                "on the calibration text, model.calibration; not with lora.experts); qerl.models.lora_init"})

    def __post_init__(self):
        if self.init not in LORA_INITS:
            raise ValueError(f"LoRA init must be one of {', '.join(LORA_INITS)}, got {self.init!r}")
        if self.r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        self.targets = tuple(self.targets)
        if not self.targets:
            raise ValueError("LoRA needs at least one target module name")
        if self.experts and self.dropout > 0:  # PEFT's ParamWrapper (the adapter format) refuses it as well
            raise ValueError(f"LoRA on MoE experts (experts: true) needs dropout 0, got {self.dropout}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)
