"""Error-compensating LoRA initialisation (`lora.init`): the adapter starts as a rank-r fit of the quantization
residual instead of zero, so the policy before any RL step is closer to the 16-bit model.

A layer's effective weight is W_q + s * B @ A (W_q the dequantized 4-bit base, s the LoRA scaling: alpha / r, or
alpha / sqrt(r) with rslora). With the residual R = W - W_q [N, K]:

- zero: PEFT's default (A Kaiming-uniform, B = 0); the model starts as the quantized base.
- loftq: s * B @ A = R_r, the rank-r truncated SVD of R (Eckart-Young: the best rank-r fit in the Frobenius
  norm, so ||W - W_q - s B A||_F <= ||R||_F, strictly unless R's top r singular values are all zero). The base
  stays the quantization qerl made (round-to-nearest, 4over6, GPTQ, AWQ), not re-quantized from W - s B A as
  LoftQ's alternation does: one SVD, and the 4-bit weights stay exactly those every other part of qerl
  (checkpoints, merge, the rollout engine) assumes.
- eora: the fit that minimises the layer's output error on its inputs, ||X (R - s B A)^T||_F for the
  calibration activations X [n, K] (EoRA: the residual seen in the eigenspace of the inputs). With
  C = X^T X / n: ||X D^T||_F^2 = n ||D C^(1/2)||_F^2, so the optimum is s B A = (R C^(1/2))_r C^(-1/2), the
  truncated SVD taken where the inputs are (directions with large input variance get the rank budget). Any
  square root S with S S^T = C gives the same optimum (S = C^(1/2) U, U orthogonal, and the truncated SVD is
  equivariant under U), so the Cholesky factor L of C serves: s B A = (R L)_r L^-1, one Cholesky and one
  triangular solve instead of an eigendecomposition (K = 8960: 1.4 s against 43 s on two CPU cores). C is
  damped by `EORA_DAMP` times its mean eigenvalue (trace / K) on the diagonal, so L is invertible (directions
  the text never excites keep a finite weight). X are the layer's inputs in the quantized model (the
  calibration runs layer by layer, the earlier layers quantized with their fitted adapters).

eora's drift fit (`EORA_DRIFT`, an experiment, off: it measured worse, docs/formats.md). The fit above ignores
that the layer's inputs drifted: the 16-bit model computes X_fp W^T, the quantized one X_q (W_q + D)^T, X_fp and
X_q [n, K] the same tokens' inputs in the two models. The drift fit is

    min over rank-r D of  ||X_fp W^T - X_q (W_q + D)^T||_F^2 / n  +  lam ||W_q + D - W||_F^2

(lam = `EORA_DRIFT_DAMP` x trace(C_qq) / K: directions the text never excites stay at the 16-bit weight). With
C_qq = X_q^T X_q / n and C_fq = X_fp^T X_q / n [K, K], it is quadratic in T = W_q + D with Hessian
C = C_qq + lam I = L L^T and stationary point T* C = W (C_fq + lam I), so D* = W (C_fq + lam I) C^-1 - W_q =
R + W (C_fq - C_qq) C^-1 (lam cancels in the difference), and up to a constant the objective is
||(D - D*) L||_F^2: by Eckart-Young in the whitened space the rank-r optimum is D = (D* L)_r L^-1, with
D* L = R L + W (C_fq - C_qq) L^-T (W multiplied first and one more triangular solve: O(N K^2), no K^3
inverse). Where X_fp = X_q (the first linears of layer 0) C_fq = C_qq, D* = R, and it is the fit above. The
calibration (`calibrated_quantize._eora_drift_layer`) then runs the 16-bit hidden states beside the quantized
ones and quantizes a layer's sibling groups one after another, each group's X_q coming from the layer as
quantized so far (with X_q from the dense layer, o_proj and down_proj would fit again the drift that q/k/v and
gate/up's adapters already removed).

Either split is balanced: with U S V^T the truncated SVD, B = U sqrt(S) / sqrt(s) and A = sqrt(S) V^T / sqrt(s)
(for eora V^T L^-1 in place of V^T). Bases kept 16-bit (format bf16) keep the zero init.

MoE expert stacks (`lora.experts`, loftq only in the pipeline): each expert's gate_up and down matrix gets its own
fit; `quantize_experts(fit=lora)` computes the factors while the 16-bit stack is at hand and leaves them on the
module (`PENDING_FACTORS`, a few MB) until `add_expert_lora` attaches the adapter and copies them in. eora on
experts needs each expert's own routed inputs (`init_expert_lora_` takes them), which the calibration pass does
not collect yet.
"""

from typing import NamedTuple

import torch

from ..nn import QuantExperts, QuantLinear

EORA_DAMP = 1e-2  # added to the covariance's diagonal, relative to its mean eigenvalue
# eora's drift fit (module docstring): an experiment, off, because it measured worse than the drift-free fit
# (docs/formats.md); `calibrated_quantize` reads it at call time, benchmarks/lora_init_kl.py's eora-drift row sets it
EORA_DRIFT = False
# its damping: 10x EORA_DAMP, the better of the two on SmolLM2 NVFP4 (KL 0.078 against 0.098 at 1e-2); the
# regression of the drift on X_q is what the damping holds back
EORA_DRIFT_DAMP = 1e-1


class EoraStatistics(NamedTuple):
    """One target linear's calibration statistics for eora's drift fit (`calibrate.drift_covariances`):
    qq = C_qq fp32 [K, K], its inputs' covariance in the quantized model; fq = C_fq fp32 [K, K], the 16-bit
    model's inputs against the quantized model's, token by token (X_fp^T X_q / n)."""
    qq: torch.Tensor
    fq: torch.Tensor


def residual_factors(residual: torch.Tensor, r: int, scaling: float, covariance: torch.Tensor | None = None,
                     damp: float = EORA_DAMP, cross: torch.Tensor | None = None,
                     weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A fp32 [r, K], B fp32 [N, r]) with D = scaling * B @ A the best rank-r fit for `residual` R = W - W_q [N, K]:
    - no covariance (loftq): of R in the Frobenius norm;
    - covariance C_qq [K, K] (the quantized model's E[x x^T] of the inputs) and no cross: of R in the
      activation-weighted norm ||(R - D) C^(1/2)||_F, C = C_qq damped (EoRA; inputs equal in both models);
    - also cross C_fq [K, K] (X_fp^T X_q / n) and `weight` W [N, K] (eora's drift fit): the minimiser of
      ||X_fp W^T - X_q (W_q + D)^T||_F^2 / n + lam ||W_q + D - W||_F^2, i.e. (D* L)_r L^-1 with
      D* L = R L + W (C_fq - C_qq) L^-T (module docstring). cross == covariance gives the previous case exactly.
    Ranks beyond min(N, K) are zero rows / columns."""
    if cross is not None and (covariance is None or weight is None):
        raise ValueError("residual_factors: the cross covariance needs the covariance and the 16-bit weight")
    res = residual.detach().float()
    n, k = res.shape
    chol = None
    if covariance is not None:
        cov = covariance.detach().float().to(res.device)
        cov = (cov + cov.t()) / 2
        floor = float(torch.diagonal(cov).mean()) if float(torch.diagonal(cov).mean()) > 0 else 1.0
        eye = torch.eye(k, device=res.device)
        for scale in (damp, 10 * damp, 100 * damp):  # more damping only where rounding broke positive-definiteness
            chol, info = torch.linalg.cholesky_ex(cov + scale * floor * eye)
            if int(info) == 0:
                break
        else:
            raise ValueError("lora.init eora: the input covariance is not positive definite even damped")
        target = res @ chol  # R L, C = L L^T
        if cross is not None:
            # + W (C_fq - C_qq) L^-T: W times the [K, K] difference first (N <= K for most targets), then solve
            # Y L^T = that for Y, against the same symmetrised C_qq that L factors
            drift = weight.detach().float().to(res.device) @ (cross.detach().float().to(res.device) - cov)
            target = target + torch.linalg.solve_triangular(chol.t(), drift, upper=True, left=False)
        res = target
    u, sv, vh = torch.linalg.svd(res, full_matrices=False)
    keep = min(r, sv.numel())
    half = sv[:keep].sqrt() / scaling ** 0.5
    b = res.new_zeros(n, r)
    a = res.new_zeros(r, k)
    b[:, :keep] = u[:, :keep] * half
    a_rows = half[:, None] * vh[:keep]
    if chol is not None:  # a_rows L^-1: solve X L = a_rows (L lower triangular)
        a_rows = torch.linalg.solve_triangular(chol, a_rows, upper=False, left=False)
    a[:keep] = a_rows
    return a, b


@torch.no_grad()
def init_linear_lora_(layer: QuantLinear, weight: torch.Tensor,
                      covariance: "EoraStatistics | torch.Tensor | None" = None) -> None:
    """Set `layer`'s adapter (attached, `layer.lora_config.init` loftq or eora) from its 16-bit weight [N, K]:
    the residual against the layer's own dequantized base. eora needs `covariance`: the calibration's
    EoraStatistics (C_qq, C_fq fp32 [K, K]; `calibrated_quantize` passes these), or a plain C [K, K] for inputs
    equal in both models (C_fq = C_qq)."""
    init = layer.lora_config.init
    if init == "zero" or layer.weight_format == "bf16":
        return
    if init == "eora" and covariance is None:
        raise ValueError("lora.init eora needs the layer's input covariance (calibration text)")
    residual = weight.detach().float() - layer.dequantized_weight(torch.float32).to(weight.device)
    cov = cross = None
    if init == "eora":
        cov, cross = covariance if isinstance(covariance, EoraStatistics) else (covariance, None)
    a, b = residual_factors(residual, layer.lora_A.out_features, layer.scaling, cov,
                            damp=EORA_DAMP if cross is None else EORA_DRIFT_DAMP, cross=cross,
                            weight=weight if cross is not None else None)
    layer.lora_A.weight.copy_(a)
    layer.lora_B.weight.copy_(b)


# the attribute on a QuantExperts holding its fitted factors until expert LoRA is attached (`add_expert_lora`)
PENDING_FACTORS = "_lora_init_factors"


@torch.no_grad()
def expert_residual_factors(experts: QuantExperts, dense: dict[str, torch.Tensor], r: int, scaling: float,
                            covariances: dict[str, torch.Tensor] | None = None) -> dict[str, tuple]:
    """{weight: (A fp32 [E, r, K], B fp32 [E, N, r])}: per expert, the residual fit of `residual_factors` against
    the 16-bit stacks `dense` {gate_up_proj: [E, 2I, H], down_proj: [E, H, I]} (QuantExperts' [N, K] layout);
    covariances {weight: [E, K, K]} for eora."""
    out = {}
    for weight, w in dense.items():
        pairs = []
        for e in range(experts.num_experts):
            residual = w[e].float() - experts.dequantized_expert(weight, e, torch.float32).to(w.device)
            cov = None if covariances is None else covariances[weight][e]
            pairs.append(residual_factors(residual, r, scaling, cov))
        out[weight] = (torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs]))
    return out


@torch.no_grad()
def set_expert_factors_(experts: QuantExperts, factors: dict[str, tuple]) -> None:
    """Copy {weight: (A [E, r, K], B [E, N, r])} into the attached expert LoRA of `experts`."""
    for weight, (a, b) in factors.items():
        experts.lora_A[weight].copy_(a)
        experts.lora_B[weight].copy_(b)


@torch.no_grad()
def init_expert_lora_(experts: QuantExperts, dense: dict[str, torch.Tensor], init: str,
                      covariances: dict[str, torch.Tensor] | None = None) -> None:
    """Set the expert LoRA of `experts` (attached) from the 16-bit stacks `dense` {gate_up_proj: [E, 2I, H],
    down_proj: [E, H, I]}, one residual fit per expert and weight. eora: `covariances` {weight: [E, K, K]}, each
    expert's own inputs (the tokens routed to it)."""
    if init == "zero":
        return
    if init == "eora" and covariances is None:
        raise ValueError("lora.init eora needs each expert's input covariance (calibration text)")
    r = experts.lora_A[next(iter(experts.lora_A))].shape[1]
    set_expert_factors_(experts, expert_residual_factors(experts, dense, r, experts.scaling,
                                                         covariances if init == "eora" else None))
