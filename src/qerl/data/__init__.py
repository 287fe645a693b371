"""Problems (hub, offline packages, reasoning-gym, local files), prompt templates, calibration text and the
completion-length profiles of real RL steps (`length_profiles`, which the benchmarks draw lengths from)."""

from .datasets import DatasetError, filter_by_length, load_problems
from .offline import gsm8k_test
from .templates import BOXED_SUFFIX, GSM8K_SUFFIX, SUFFIXES, build_prompt, encode_prompt

__all__ = ["BOXED_SUFFIX", "DatasetError", "GSM8K_SUFFIX", "SUFFIXES", "build_prompt", "encode_prompt",
           "filter_by_length", "gsm8k_test", "load_problems"]
