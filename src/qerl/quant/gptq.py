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
    """H fp32 [K, K] -> upper Cholesky factor U of H_damped^-1 (fp32 [K, K]), as GPTQ consumes it.

    Without forming H^-1: with J the index reversal, J H J = L L^T gives H = R R^T for the upper
    triangular R = J L J, so H^-1 = R^-T R^-1 and U = R^-1 (unique: positive diagonal). One Cholesky and
    one triangular solve instead of Cholesky, LAPACK's cholesky_inverse and a second Cholesky (and
    cholesky_inverse can stall for seconds when its threads share busy CPU cores)."""
    h = hessian.detach().double().clone()
    if not torch.isfinite(h).all():
        raise HessianError("calibration Hessian has non-finite entries")
    dead = torch.diagonal(h) <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1.0
    mean_diag = torch.diagonal(h).mean()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for attempt in range(4):
        damped = h + (damp * 10 ** attempt) * mean_diag * eye
        chol, info = torch.linalg.cholesky_ex(damped.flip(0, 1))
        if int(info) == 0:
            upper = torch.linalg.solve_triangular(chol.flip(0, 1), eye, upper=True)
            if torch.isfinite(upper).all():
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
        cols = work[:, c0:c1].t().contiguous()  # [c, N]: one column per row, so each step reads contiguously
        errs = torch.empty_like(cols)
        u_blk = u[c0:c1, c0:c1]
        for i in range(c1 - c0):
            if i % BLOCK == 0:
                s, _ = choose_block_scales(cols[i:i + BLOCK].t(), gs, search)
                scales[:, (c0 + i) // BLOCK] = s[:, 0]
                step = s[:, 0].float() / gs
            q = round_e2m1_values(cols[i] / step).mul_(step)
            err = errs[i]
            torch.sub(cols[i], q, out=err).div_(u_blk[i, i])
            cols[i + 1:].addr_(u_blk[i, i + 1:], err, alpha=-1)  # spread the error over the later columns
            cols[i] = q
        work[:, c0:c1] = cols.t()
        work[:, c1:].addmm_(errs.t(), u[c0:c1, c1:], alpha=-1)
    return encode_nvfp4(work, scales, gs)
