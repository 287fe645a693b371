"""What the quantize stage is asked to do, resolved and checked once: `Quantization`.

`load_policy` builds one from its ModelSpec and `quantize_model` from its arguments; `stream.build_from`,
`stream_quantized`, `random_policy` and `convert.quantize_as` take one, and the stages under them (the
layer-by-layer builder, the calibration loop, the surgery) read its fields and check nothing again.
"""

from dataclasses import dataclass
from typing import Iterable

import torch

from ..choices import check_keep_bf16
from ..formats import WeightFormat, get_format
from ..lora_config import DEFAULT_TARGETS, LoraConfig
from ..quant import CALIBRATED, check_method


@dataclass(frozen=True, eq=False)
class Quantization:
    """format: the base's weight format (the 16-bit form is "bf16"); method: how codes and scales are chosen
    (`qerl.quant`); targets: the leaf names of the linears quantized; keep_bf16: module names / patterns /
    last:N of targets left 16-bit (`precision`); embeddings: also store the untied input embedding in `format`;
    lora: the fresh adapters, attached (and with lora.init loftq / eora fitted) while the 16-bit weights are at
    hand; calibration: token ids int64 [S, T] for the calibrated methods and eora (`calibration.calibration_ids`)."""

    format: WeightFormat
    method: str = "rtn"
    targets: tuple[str, ...] = DEFAULT_TARGETS
    keep_bf16: tuple[str, ...] = ()
    embeddings: bool = False
    lora: LoraConfig | None = None
    calibration: torch.Tensor | None = None

    @classmethod
    def of(cls, fmt: str | WeightFormat, method: str = "rtn", *, targets: Iterable[str] = DEFAULT_TARGETS,
           keep_bf16: Iterable[str] = (), embeddings: bool = False, lora: LoraConfig | None = None,
           calibration: torch.Tensor | None = None) -> "Quantization":
        """The format resolved from its name, the method checked against it and the keep_bf16 entries' syntax
        (`choices.check_keep_bf16`): ValueError naming what is wrong."""
        fmt = get_format(fmt)
        check_method(method, fmt)
        return cls(fmt, method, tuple(targets), tuple(check_keep_bf16(keep_bf16)), embeddings, lora, calibration)

    @property
    def eora(self) -> bool:
        """The adapters are fitted on the calibration text's activations (lora.init eora)."""
        return self.lora is not None and self.lora.init == "eora"

    @property
    def calibrated(self) -> bool:
        """The model runs over the calibration tokens while it is quantized (gptq, awq, or eora's fit)."""
        return self.method in CALIBRATED or self.eora
