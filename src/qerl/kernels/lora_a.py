"""h = x @ A^T for the LoRA "A" products of the rollout engine's decode step, in one launch on CUDA.

Why: at decode each group of sibling linears computes h = x @ A^T with x [M, K] (M = batch rows <= 64,
K = 3584 / 18944 for Qwen2.5-7B) and A [R, K] (R = the group's stacked LoRA ranks, 8..256). The product
is tiny and latency-bound, and cuBLAS runs it as a split-K GEMM plus a separate splitKreduce kernel: two
launches (H200: ~4.8 us + ~1.6 us), 112 calls per 7B decode step. `triton.lora_a` does it in one launch.

Design (`triton.lora_a`): grid (cdiv(R, BR), splits, M tiles of <= 32 rows). Each program computes the
fp32 partial product of one (R, M) tile over one slice of K and stores it to a cached fp32 workspace, then
increments the tile's int32 arrival counter (acq_rel atomic, after a CTA barrier). The program that
arrives last sums the tile's partials in a fixed order (deterministic), rounds once to the 16-bit dtype,
writes h and resets the counter to 0, so the next launch (e.g. a CUDA graph replay) starts clean. With
one split it writes h directly. Workspace and counters are allocated once per shape and kept, so the
call can be captured in a CUDA graph; the first call for a shape should run outside capture (it also
compiles the kernel): a first call inside a capture takes the cuBLAS path instead (the zeroing of new
counters cannot run then).

The workspace and counters are kept per CUDA stream (`workspace.persistent`): calls in flight together on
two streams do not share them. A capture finds them made by a warm-up on the capture stream itself.
"""

import warnings

import torch

from .route import use_triton

MAX_M = 64  # rows up to here take the one-launch kernel (decode batches); above it cuBLAS is efficient


def lora_a(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x [..., K], a [R, K] (same dtype) -> h = x @ a^T as [M, R], M = the product of x's leading dims.

    Triton path (one launch, fp32 accumulation, one rounding to x's dtype) for CUDA bf16/fp16 x with
    M <= MAX_M, a contiguous and of x's dtype and device; otherwise exactly `x.reshape(-1, K) @ a.t()`.
    The caller reshapes h.
    """
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if (use_triton(x) and 1 <= M <= MAX_M and K > 0 and a.dtype == x.dtype and a.device == x.device and a.ndim == 2
            and a.shape[1] == K and a.is_contiguous() and a.shape[0] > 0):
        from .triton import lora_a as tla

        if torch.cuda.is_current_stream_capturing() and not tla.has_buffers(x.device, M, a.shape[0], K):
            # new counters must be zeroed before the first launch, which a capture cannot do eagerly
            warnings.warn(f"lora_a: first call for shape M={M}, R={a.shape[0]}, K={K} inside a CUDA graph "
                          "capture; using cuBLAS for it (call it once outside the capture first)")
            return x2 @ a.t()
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return tla.lora_a_triton(x2, a)
    return x2 @ a.t()
