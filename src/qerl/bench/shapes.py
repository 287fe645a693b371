"""The benchmarks' model shapes: `qerl.models.shapes` (the random-weight source of the loader reads them too)."""

from ..models.shapes import MOE_SHAPES, QWEN25, SMOLLM2_135M, linear_shapes, moe_config, qwen25_config

__all__ = ["MOE_SHAPES", "QWEN25", "SMOLLM2_135M", "linear_shapes", "moe_config", "qwen25_config"]
