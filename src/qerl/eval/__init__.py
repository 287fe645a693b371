"""Evaluation: pass@1 on math problems (`evaluate`, `qerl eval`) and quantization fidelity."""

from .evaluate import add_eval_arguments, evaluate, run_eval

__all__ = ["add_eval_arguments", "evaluate", "run_eval"]
