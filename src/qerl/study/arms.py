"""A study arm, FORMAT[-METHOD][/INIT][+aqn[=SIGMA]][:DECAY][@LR]: the weight format, how it is quantized, how the
adapter starts (`lora.init`: zero when omitted, loftq, eora), whether AQN is on and at which starting sigma, its
sigma decay, and a learning rate of its own (e.g. nvfp4, nvfp4-gptq+aqn, nvfp4-awq/eora+aqn, nf4/loftq,
nvfp4+aqn:linear, nvfp4+aqn=0.1 for noise ten times the paper's, nvfp4@5e-4 for a learning-rate sweep per format).
Without =SIGMA the study's aqn.sigma_start/sigma_end apply; with it sigma falls from SIGMA to SIGMA times the
paper's end/start ratio (5e-4 / 1e-2 = 1/20). Without @LR the study's optim.lr applies."""

import re
from dataclasses import dataclass

from ..choices import LORA_INITS
from ..config import AQNSection, LoraSection, ModelSection
from ..formats import FORMATS
from ..quant import METHODS
from ..rl.aqn import DECAYS

DEFAULT_DECAY = AQNSection.decay
DEFAULT_METHOD = ModelSection.quant_method
DEFAULT_INIT = LoraSection.init
SIGMA_END_RATIO = AQNSection.sigma_end / AQNSection.sigma_start  # the paper's 5e-4 / 1e-2


class StudyError(ValueError):
    """A bad arm, seed list or setting; the message says which and what is allowed."""




@dataclass(frozen=True)
class Arm:
    format: str
    aqn: bool = False
    decay: str = DEFAULT_DECAY
    method: str = DEFAULT_METHOD
    lr: float | None = None  # None: the study's optim.lr
    sigma: float | None = None  # AQN's starting sigma; None: the study's aqn.sigma_start (and sigma_end)
    init: str = DEFAULT_INIT  # lora.init

    @property
    def name(self) -> str:
        """Canonical spelling: the default method, init and decay are left out."""
        return (self.format + (f"-{self.method}" if self.method != DEFAULT_METHOD else "")
                + (f"/{self.init}" if self.init != DEFAULT_INIT else "") + ("+aqn" if self.aqn else "")
                + (f"={self.sigma:g}" if self.sigma is not None else "")
                + (f":{self.decay}" if self.decay != DEFAULT_DECAY else "")
                + (f"@{self.lr:g}" if self.lr is not None else ""))

    @property
    def slug(self) -> str:
        """The name as a directory name."""
        return self.name.replace("+", "_").replace(":", "_").replace("@", "_lr").replace("=", "-s").replace("/", "_")

    def overrides(self) -> list[str]:
        return [f"model.format={self.format}", f"model.quant_method={self.method}",
                f"aqn.enabled={'true' if self.aqn else 'false'}", f"aqn.decay={self.decay}",
                *([f"optim.lr={self.lr:g}"] if self.lr is not None else []),
                *([f"lora.init={self.init}"] if self.init != DEFAULT_INIT else []),
                *([f"aqn.sigma_start={self.sigma:g}", f"aqn.sigma_end={self.sigma * SIGMA_END_RATIO:g}"]
                  if self.sigma is not None else [])]


_ARM = re.compile(r"^(?P<format>[a-z0-9]+)(?:-(?P<method>[a-z0-9]+))?(?:/(?P<init>[a-z0-9]+))?"
                  r"(?P<aqn>\+aqn(?:=(?P<sigma>[0-9.eE+-]+))?)?"
                  r"(?::(?P<decay>[a-z]+))?"
                  r"(?:@(?P<lr>[0-9.eE+-]+))?$")


def _number_in(text: str, raw: str | None, what: str, upper: float, example: str) -> float | None:
    """The arm's `raw` number (None when absent), refused unless in (0, upper)."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < upper:
        raise StudyError(f"arm {text!r}: {what} {raw!r} must be a number in (0, {upper:g}), e.g. {example}")
    return value


def parse_arm(text: str) -> Arm:
    m = _ARM.match(text.strip())
    if not m:
        raise StudyError(f"arm {text!r}: expected FORMAT[-METHOD][/INIT][+aqn[=SIGMA]][:DECAY][@LR], e.g. nvfp4, "
                         "nvfp4-gptq+aqn, nvfp4/eora+aqn, nvfp4+aqn:linear, nvfp4+aqn=0.1, nvfp4@5e-4")
    fmt, aqn, decay, method = m["format"], bool(m["aqn"]), m["decay"], m["method"] or DEFAULT_METHOD
    if fmt not in FORMATS:
        raise StudyError(f"arm {text!r}: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if decay is not None and not aqn:
        raise StudyError(f"arm {text!r}: a decay only makes sense with AQN; write {fmt}+aqn:{decay}")
    if decay is not None and decay not in DECAYS:
        raise StudyError(f"arm {text!r}: unknown AQN decay {decay!r}; choose one of {', '.join(DECAYS)}")
    if method not in METHODS:
        raise StudyError(f"arm {text!r}: unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    init = m["init"] or DEFAULT_INIT
    if init not in LORA_INITS:
        raise StudyError(f"arm {text!r}: unknown adapter init {init!r}; choose one of {', '.join(LORA_INITS)}")
    if init != DEFAULT_INIT and fmt == "bf16":
        raise StudyError(f"arm {text!r}: {init} fits the quantization residual, and a bf16 base has none")
    sigma = _number_in(text, m["sigma"], "AQN sigma", 10, "0.1")
    lr = _number_in(text, m["lr"], "learning rate", 1, "5e-4")
    return Arm(fmt, aqn, decay or DEFAULT_DECAY, method, lr, sigma, init)


def parse_arms(text: str) -> list[Arm]:
    arms = [parse_arm(a) for a in text.split(",") if a.strip()]
    if not arms:
        raise StudyError("--arms: no arm given")
    seen = set()
    for arm in arms:
        if arm in seen:
            raise StudyError(f"--arms: {arm.name} is given twice")
        seen.add(arm)
    return arms
