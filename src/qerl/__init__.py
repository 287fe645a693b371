"""qerl: RL post-training of LLMs with LoRA on a frozen 4-bit (NVFP4) base and Adaptive Quantization Noise.

Pipeline, in package order: formats -> kernels -> nn -> models -> rollout -> rl -> cli.
"""

__version__ = "0.1.0"
