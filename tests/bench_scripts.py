"""benchmarks/NAME.py and experiments/NAME.py loaded as modules for tests (the scripts are not a package)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(folder: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module."""
    return _load("benchmarks", name)


def load_experiment(name: str):
    """experiments/NAME.py as a module."""
    return _load("experiments", name)


def load_peer(name: str):
    """benchmarks/peers/NAME.py as a module."""
    return _load("benchmarks/peers", name)
