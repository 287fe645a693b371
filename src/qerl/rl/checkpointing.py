"""Training checkpoints: the adapter (PEFT) plus everything the run's future depends on.

`<run>/checkpoints/step-000010/` holds `adapter/` and `trainer_state.pt` (optimizer, LR scheduler,
step, data position, every RNG, and the resolved config); written atomically, the last `keep_last` kept.
"""

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..models.adapter import save_adapter
from ..models.atomic import atomic_directory
from ..quant import CALIBRATED

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{6})$")


def rng_state(generator: torch.Generator) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "sampler": generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["sampler"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, trainer_state: dict, keep_last: int,
                    name: str | None = None) -> Path:
    """Write checkpoints/step-NNNNNN (or checkpoints/<name>) atomically; prune to the last keep_last steps."""
    out = run_dir / "checkpoints" / (name or f"step-{step:06d}")
    with atomic_directory(out, overwrite=True, kind="checkpoint", check_owner=False) as tmp:
        save_adapter(model, tmp / "adapter", original_base=False)  # as trained: resume reloads it as is
        torch.save({"format_version": FORMAT_VERSION, "qerl_version": __version__, "torch_version": torch.__version__,
                    "step": step, **trainer_state}, tmp / "trainer_state.pt")
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return out


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp directories of an interrupted write are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "trainer_state.pt").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


# Settings a resumed run must share with its checkpoint: they define the model and the adapter's shape.
RESUME_KEYS = (("model", "name"), ("model", "format"), ("model", "quant_method"), ("model", "keep_bf16"),
               ("model", "calibration"), ("model", "quantize_embeddings"), ("lora", "r"), ("lora", "alpha"),
               ("lora", "targets"), ("lora", "use_rslora"), ("lora", "init"),
               ("data", "train"),
               ("moe", "train_router"))  # a trained router is in the adapter and the optimizer state
# What a checkpoint written before a key existed meant by leaving it out (fixed: later defaults may differ).
_ADDED_LATER = {("model", "quantize_embeddings"): False, ("model", "quant_method"): "rtn", ("model", "keep_bf16"): [],
                ("model", "calibration"): {"source": "auto", "samples": 128, "max_tokens": 256},
                ("moe", "train_router"): False, ("lora", "init"): "zero"}


def check_same_run(saved: dict, current: dict, checkpoint: Path) -> None:
    """ValueError naming every RESUME_KEYS setting in which the config `current` differs from the checkpoint's
    `saved` one (both as `qerl.config.to_dict` writes them)."""
    def old(a, b):
        section = saved.get(a, {})  # a whole section may be newer than the checkpoint
        return section[b] if b in section else _ADDED_LATER[(a, b)]

    keys = RESUME_KEYS
    if current["model"]["quant_method"] not in CALIBRATED:  # the calibration text shapes only gptq / awq models
        keys = [k for k in keys if k != ("model", "calibration")]
    diffs = [f"{a}.{b}: checkpoint {old(a, b)!r}, now {current[a][b]!r}" for a, b in keys
             if old(a, b) != current[a][b]]
    if diffs:
        raise ValueError(f"{checkpoint} belongs to a different run ({'; '.join(diffs)})")


# Settings that act only on steps not taken yet (when to stop, save, log and plot): a resumed run may change
# them, and the change is recorded with the step it took effect at. Any other setting shaped the earlier
# steps; changing it on --resume needs --override (`config_changes`).
FUTURE_ONLY_KEYS = frozenset({"steps", "save_every", "keep_last", "keep_best", "tensorboard", "plots",
                              "output_dir", "max_reward_failure_steps", "optim.max_bad_steps",
                              "optim.gradient_checkpointing"})
CONFIG_CHANGES_FILE = "config_changes.jsonl"


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(dotted key, saved value, new value) for every setting in which `current` differs from the checkpoint's
    `saved` config (both as `qerl.config.to_dict` writes them). Keys the saved config lacks (written before the
    key existed) are not changes; nor is the calibration text of a method that reads none."""
    old, new = _flatten(saved), _flatten(current)
    changes = [(k, old[k], v) for k, v in new.items() if k in old and old[k] != v]
    method = new.get("model.quant_method")
    if method not in CALIBRATED and old.get("model.quant_method") == method:
        changes = [c for c in changes if not c[0].startswith("model.calibration.")]
    return changes


def check_resume_changes(saved: dict, current: dict, checkpoint: Path,
                         overrides=()) -> list[tuple[str, object, object]]:
    """The config changes a resumed run may make -> their list; ValueError naming every other one.

    Keys in RESUME_KEYS (the model and the adapter's shape) can never change (`check_same_run`); keys in
    FUTURE_ONLY_KEYS always may; any other key only when named in `overrides` (`--override KEY`). An override
    naming a key that did not change, or no key at all, is refused too (a typo would otherwise pass silently)."""
    check_same_run(saved, current, checkpoint)
    changes = config_changes(saved, current)
    changed = {k for k, _, _ in changes}
    unknown = [k for k in overrides if k not in _flatten(current)]
    if unknown:
        raise ValueError(f"--override {' '.join(unknown)}: no such config key")
    unused = [k for k in overrides if k not in changed]
    if unused:
        them = "it" if len(unused) == 1 else "them"
        raise ValueError(f"--override {' '.join(unused)}: the config does not change {them} "
                         "(nothing to override)")
    refused = [(k, a, b) for k, a, b in changes if k not in FUTURE_ONLY_KEYS and k not in overrides]
    if refused:
        listed = "; ".join(f"{k}: run {a!r}, now {b!r}" for k, a, b in refused)
        keys = " ".join(k for k, _, _ in refused)
        raise ValueError(f"--resume: the config differs from the run's ({listed}); the earlier steps were made with "
                         f"the run's values. Keep them, or change them from the checkpoint's step on with "
                         f"--resume --override {keys}")
    return changes


def record_config_changes(run_dir: Path, step: int, changes, overrides=()) -> None:
    """Append the accepted changes to <run>/config_changes.jsonl: {step, key, from, to, override}."""
    if not changes:
        return
    with open(Path(run_dir) / CONFIG_CHANGES_FILE, "a", encoding="utf-8") as f:
        for key, old, new in changes:
            f.write(json.dumps({"step": step, "key": key, "from": old, "to": new, "override": key in overrides}) + "\n")


def load_trainer_state(checkpoint: Path) -> dict:
    try:
        state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(f"{checkpoint / 'trainer_state.pt'}: unreadable checkpoint "
                         f"({type(e).__name__}: {e})") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{checkpoint}: checkpoint format {state.get('format_version')} != {FORMAT_VERSION} "
                         f"(written by qerl {state.get('qerl_version')})")
    return state
