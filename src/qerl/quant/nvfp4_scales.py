"""Choosing NVFP4 block and global scales by error instead of by the block maximum.

compressed-tensors' round-to-nearest maps each 16-block's maximum onto E2M1's largest value, 6
(`weight_scale = e4m3(global_scale * amax / 6)`). E2M1 has nothing between 4 and 6, so a block whose
values crowd near its maximum loses them all to one of the two; mapping the maximum onto 4 instead
("Four Over Six") or taking a neighbouring E4M3 scale often halves a block's error. The file format does
not record how a scale was chosen: any choice keeps `weight_packed`, `weight_scale` and
`weight_global_scale` with their compressed-tensors meaning, so every loader and kernel reads it unchanged.

Candidate scales per block are E4M3 values found by stepping the E4M3 bit pattern (monotonic for positive
values) from the round-to-nearest scale; the candidate with the least (optionally column-weighted)
squared error wins, ties going to round-to-nearest.
"""

import torch

from ..formats.fp4 import E2M1_MAX, pack_fp4, round_to_e2m1
from ..formats.nvfp4 import BLOCK, E4M3_MAX, nvfp4_global_scale

# E4M3 bit-pattern steps tried around the round-to-nearest scale: one step is 1/8 to 1/16 of an octave,
# so +5 reaches the "maximum onto 4" scale (x1.5). Chosen on SmolLM2 (benchmarks/quant_methods.py).
SEARCH_STEPS = (0, -1, 1, 2, 3, 4, 5)
FOUR_OVER_SIX_TARGETS = (6.0, 4.0)
_E4M3_MAX_BITS = 0x7E  # 448; 0x7F is NaN
_ROW_CHUNK_ELEMENTS = 1 << 24  # rows per pass bounded so a 7B layer's candidates fit in a few hundred MB


def e4m3_positive(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> float8_e4m3fn, saturating at 448 and replacing 0 by 0.125 (as compressed-tensors)."""
    s = x.clamp(0, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.where(s.float() == 0, torch.full_like(s.float(), 0.125), s.float()).to(torch.float8_e4m3fn)


def step_e4m3(scale: torch.Tensor, steps: int) -> torch.Tensor:
    """Positive float8_e4m3fn scales moved `steps` representable values up (or down), kept in [2^-9, 448]."""
    bits = scale.view(torch.uint8).to(torch.int16) + steps
    return bits.clamp(1, _E4M3_MAX_BITS).to(torch.uint8).view(torch.float8_e4m3fn)


def block_codes(blocks: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """blocks fp32 [..., 16], scale e4m3 [...], global fp32 [1] -> E2M1 codes uint8 [..., 16] (RNE, clamped)."""
    step = scale.float() / global_scale
    return round_to_e2m1((blocks / step.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))


def round_e2m1_values(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their step) -> the nearest E2M1 values, fp32, ties to even codes.

    Equals decode_e2m1(round_to_e2m1(x)) (tested) at a fraction of the cost: E2M1 is a grid of spacing 0.5
    up to 2, 1 up to 4 and 2 up to 6, and torch.round's half-to-even lands ties on even codes there."""
    x = x.clamp(-E2M1_MAX, E2M1_MAX)
    mag = x.abs()
    spacing = (mag > 2).float().add_(1).mul_(0.5).add_((mag > 4).float())  # 0.5, 1 or 2
    return torch.round(x / spacing).mul_(spacing)


def block_error(blocks: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """Squared error of quantizing blocks fp32 [..., 16] with scales e4m3 [...]: fp32 [...].

    weight: optional fp32 [..., 16] (broadcastable) per-element importance, e.g. the mean squared input of
    each column (the diagonal of the calibration Hessian)."""
    step = (scale.float() / global_scale).unsqueeze(-1)
    deq = round_e2m1_values(blocks / step) * step
    err = (blocks - deq).square()
    return (err if weight is None else err * weight).sum(-1)


def candidate_scales(blocks: torch.Tensor, global_scale: torch.Tensor, search: str) -> torch.Tensor:
    """blocks fp32 [R, B, 16] -> candidate e4m3 scales [C, R, B]; candidate 0 is round-to-nearest's."""
    amax = blocks.abs().amax(-1)
    if search == "rtn":
        return e4m3_positive(global_scale * amax / E2M1_MAX).unsqueeze(0)
    if search == "4over6":
        return torch.stack([e4m3_positive(global_scale * amax / t) for t in FOUR_OVER_SIX_TARGETS])
    if search == "mse":
        rtn = e4m3_positive(global_scale * amax / E2M1_MAX)
        return torch.stack([step_e4m3(rtn, s) for s in SEARCH_STEPS])
    raise ValueError(f"unknown NVFP4 scale search {search!r}; choose rtn, 4over6 or mse")


def choose_block_scales(w: torch.Tensor, global_scale: torch.Tensor, search: str = "mse",
                        weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block E4M3 scales for W [N, K] (K % 16 == 0) under a fixed global scale fp32 [1].

    weight: optional fp32 [K] per-column importance. Returns (scales e4m3 [N, K/16], error fp32 [N, K/16]);
    with one candidate ("rtn") the scales equal compressed-tensors' bit for bit."""
    n, k = w.shape
    gs = global_scale.float().reshape(1).to(w.device)
    col_w = None if weight is None else weight.float().to(w.device).reshape(1, k // BLOCK, BLOCK)
    rows = max(1, _ROW_CHUNK_ELEMENTS // (k * 8))
    scales, errors = [], []
    for r0 in range(0, n, rows):
        blocks = w[r0:r0 + rows].float().reshape(-1, k // BLOCK, BLOCK)
        cands = candidate_scales(blocks, gs, search)
        err = torch.stack([block_error(blocks, c, gs, col_w) for c in cands])  # [C, R, B]
        best = err.argmin(0)  # first minimum: ties keep the earlier candidate (round-to-nearest first)
        # gather on the bit patterns: fp8 has no gather kernel on the CPU
        bits = cands.view(torch.uint8).gather(0, best.unsqueeze(0)).squeeze(0)
        scales.append(bits.view(torch.float8_e4m3fn))
        errors.append(err.gather(0, best.unsqueeze(0)).squeeze(0))
    return torch.cat(scales), torch.cat(errors)


def encode_nvfp4(w: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """W [N, K] with chosen scales e4m3 [N, K/16] and global fp32 [1] -> the three NVFP4 tensors."""
    n, k = w.shape
    gs = global_scale.float().reshape(1).to(w.device)
    codes = block_codes(w.float().reshape(n, k // BLOCK, BLOCK), scales, gs).reshape(n, k)
    return {"weight_packed": pack_fp4(codes), "weight_scale": scales, "weight_global_scale": gs}


def global_scale_candidates(ws: list[torch.Tensor], search: str) -> list[torch.Tensor]:
    """Global scales to try for a group sharing one (q/k/v, gate/up): fp32 [1] each, round-to-nearest's first.

    A scale searched up to "maximum onto 4" needs global_scale <= 448*4/amax, or the largest blocks' E4M3
    scales saturate at 448; so searched methods also try that global scale."""
    rtn = torch.stack([nvfp4_global_scale(w) for w in ws]).amin(0)
    if search == "rtn":
        return [rtn]
    return [rtn, rtn * (4.0 / 6.0)]


def quantize_nvfp4_searched(ws: list[torch.Tensor], search: str = "mse",
                            weights: list[torch.Tensor | None] | None = None) -> list[dict[str, torch.Tensor]]:
    """Quantize a group of weights [N_i, K_i] sharing one global scale, choosing scales by error.

    weights: optional per-column importances fp32 [K_i] (None entries allowed). The global scale is the
    candidate with the least total error over the group. Returns one NVFP4 tensor dict per weight."""
    weights = weights or [None] * len(ws)
    best, best_err = None, None
    for gs in global_scale_candidates(ws, search):
        chosen = [choose_block_scales(w, gs, search, cw) for w, cw in zip(ws, weights)]
        total = sum(float(e.double().sum()) for _, e in chosen)
        if best_err is None or total < best_err:
            best, best_err = (gs, [s for s, _ in chosen]), total
    gs, scales = best
    return [encode_nvfp4(w, s, gs.clone()) for w, s in zip(ws, scales)]  # own copies: safetensors refuses shared
