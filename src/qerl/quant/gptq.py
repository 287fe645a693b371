"""GPTQ (Frantar et al., 2022) onto the NVFP4 grid.

Columns of W [N, K] are rounded one at a time, in order; each column's rounding error is spread over the
columns not yet rounded through the inverse of the calibration Hessian H = E[x x^T] [K, K], so that the
layer's output on calibration inputs, not its weights, stays close. The 16-column block scales are chosen
when the rounding reaches a block, on the already error-compensated values (`choose_block_scales`); the
global scale is fixed beforehand (it is shared by fused siblings, which GPTQ handles as one weight of
concatenated rows, since rows are independent given H).

Dampening: H + damp * mean(diag H) * I. Input channels never seen in calibration (diag 0) get H_jj = 1 and
keep their value up to rounding. If the dampened H is still not positive definite the damping grows x10
(up to three times); a non-finite or hopeless H raises `HessianError`, on which callers fall back to the
calibration-free scale search (documented in docs/formats.md).
"""

import torch

from ..formats.nvfp4 import BLOCK
from .nvfp4_scales import choose_block_scales, encode_nvfp4, round_e2m1_values

LAZY_COLUMNS = 128  # columns updated together (a multiple of the 16-column block)


class HessianError(ValueError):
    """The calibration Hessian cannot be used (non-finite, or not positive definite after dampening)."""


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """H fp32 [K, K] -> upper Cholesky factor U of H_damped^-1 (fp32 [K, K]), as GPTQ consumes it."""
    h = hessian.detach().double().clone()
    if not torch.isfinite(h).all():
        raise HessianError("calibration Hessian has non-finite entries")
    dead = torch.diagonal(h) <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1.0
    mean_diag = torch.diagonal(h).mean()
    for attempt in range(4):
        damped = h + (damp * 10 ** attempt) * mean_diag * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
        chol, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0 and torch.isfinite(upper).all():
                return upper.float()
    raise HessianError(f"calibration Hessian is not positive definite even with damping {damp * 1000:g}")


def gptq_nvfp4(w: torch.Tensor, hessian: torch.Tensor, global_scale: torch.Tensor, damp: float = 0.01,
               search: str = "mse") -> dict[str, torch.Tensor]:
    """Quantize W [N, K] (K % 16 == 0) to NVFP4 with GPTQ error feedback.

    hessian: fp32 [K, K], proportional to E[x x^T] over calibration inputs; global_scale: fp32 [1] (the
    divisor, shared by siblings). Block scales: `search` ("rtn", "4over6", "mse") on the compensated
    values. Returns the NVFP4 tensors {weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16],
    weight_global_scale fp32 [1]}. Raises HessianError (see the module docstring)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"gptq: {k} input features is not a multiple of {BLOCK}")
    if hessian.shape != (k, k):
        raise ValueError(f"gptq: Hessian shape {tuple(hessian.shape)} does not match {k} input features")
    u = inverse_hessian_factor(hessian.to(w.device), damp)
    gs = global_scale.float().reshape(1).to(w.device)
    work = w.detach().float().clone()
    scales = torch.empty(n, k // BLOCK, dtype=torch.float8_e4m3fn, device=w.device)
    for c0 in range(0, k, LAZY_COLUMNS):
        c1 = min(c0 + LAZY_COLUMNS, k)
        cols = work[:, c0:c1].clone()
        errs = torch.empty_like(cols)
        u_blk = u[c0:c1, c0:c1]
        for i in range(c1 - c0):
            if i % BLOCK == 0:
                s, _ = choose_block_scales(cols[:, i:i + BLOCK], gs, search)
                scales[:, (c0 + i) // BLOCK] = s[:, 0]
                step = scales[:, (c0 + i) // BLOCK].float() / gs
            q = round_e2m1_values(cols[:, i] / step) * step
            err = (cols[:, i] - q) / u_blk[i, i]
            cols[:, i:] -= err.unsqueeze(1) * u_blk[i, i:].unsqueeze(0)
            cols[:, i] = q
            errs[:, i] = err
        work[:, c0:c1] = cols
        work[:, c1:] -= errs @ u[c0:c1, c1:]
    return encode_nvfp4(work, scales, gs)
