"""The training config documents itself: every key's help is in its field's metadata, docs/config.md is generated
from it, and qerl.config is a leaf module (the allowed values live in qerl.choices)."""

import ast
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from qerl import choices, config
from qerl.config import MARKDOWN_COMMAND, TrainConfig, config_help, config_markdown, config_sections

ROOT = Path(__file__).resolve().parents[1]


def _entries():
    return [e for _, _, entries in config_sections() for e in entries]


def test_every_field_has_help():
    entries = _entries()
    assert len(entries) > 80
    missing = [e["key"] for e in entries if not e["help"].strip()]
    assert not missing, f"config keys without metadata help: {missing}"
    # the sections themselves too (TrainConfig's section fields)
    assert all(f.metadata.get("help") for f in dataclasses.fields(TrainConfig))


def test_help_lists_every_key_once():
    text = config_help()
    for e in _entries():
        assert text.count(f"  {e['key']} (") == 1, e["key"]
    assert "  algo.name (str, grpo): " in text and "One of: grpo, dapo, dr_grpo." in text
    assert "  model.calibration.samples (int | None, null): " in text
    assert "  lora.targets (list[str], [q_proj, " in text


def test_keys_match_what_load_config_accepts():
    """The documented keys are exactly the config's (to_dict flattens the same dataclasses)."""
    def flat(d, prefix=""):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    assert sorted(e["key"] for e in _entries()) == sorted(flat(config.to_dict(TrainConfig())))


def test_docs_config_md_is_generated():
    doc = ROOT / "docs" / "config.md"
    assert doc.is_file() and doc.read_text() == config_markdown(), \
        f"docs/config.md is out of date with src/qerl/config.py; regenerate it: {MARKDOWN_COMMAND}"


def test_module_entry_point_prints_markdown():
    out = subprocess.run([sys.executable, "-m", "qerl.config", "--markdown"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out == config_markdown()


def test_config_imports_nothing_up_the_pipeline():
    """qerl.config (and the leaf modules it imports) pull in no other qerl module, nor torch."""
    src = (ROOT / "src" / "qerl" / "config.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.level:
            imported.add(node.module)
    assert imported <= {"choices", "lora_config"}, imported
    code = "import sys, qerl.config; print(sorted(m for m in sys.modules if m.startswith(('qerl.', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['qerl.choices', 'qerl.config', 'qerl.lora_config']"


@pytest.mark.parametrize("module, name, value", [
    ("qerl.rl.losses", "ALGOS", choices.ALGOS),
    ("qerl.rl.aqn", "DECAYS", choices.DECAYS),
    ("qerl.rl.lr_schedule", "SCHEDULES", choices.SCHEDULES),
    ("qerl.rl.update", "OLD_LOGPROBS", choices.OLD_LOGPROBS),
    ("qerl.rollout.scheduler", "SCHEDULERS", choices.SCHEDULERS),
    ("qerl.quant", "METHODS", choices.METHODS),
    ("qerl.nn", "DEFAULT_TARGETS", config.DEFAULT_TARGETS),
    ("qerl.models.precision", "check_keep_bf16", choices.check_keep_bf16),
])
def test_values_defined_once_and_re_exported(module, name, value):
    assert getattr(importlib.import_module(module), name) is value


def test_format_names_are_the_formats():
    from qerl.formats import FORMATS
    assert tuple(FORMATS) == choices.FORMAT_NAMES
    from qerl.nn import LoraConfig
    assert LoraConfig is config.LoraConfig
