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
  the text never excites keep a finite weight).

With `output_covariance` G [N, N] as well (E[g g^T] of the gradients reaching the layer's outputs, a Fisher
weight on the output channels), the fit minimises ||L_G^T (R - s B A) L||_F (G = L_G L_G^T, damped by `output_damp`
times its mean eigenvalue): s B A = L_G^-T (L_G^T R L)_r L^-1, the rank going where the inputs are large and the
loss is sensitive (`benchmarks/lora_init_kl.py --inits eora-fisher` measures it; no `lora.init` uses it yet).

Either split is balanced: with U S V^T the truncated SVD, B = U sqrt(S) / sqrt(s) and A = sqrt(S) V^T / sqrt(s)
(for eora V^T L^-1 in place of V^T). Bases kept 16-bit (format bf16) keep the zero init.

MoE expert stacks (`lora.experts`, loftq only in the pipeline): each expert's gate_up and down matrix gets its own
fit; `quantize_experts(fit=lora)` computes the factors while the 16-bit stack is at hand and leaves them on the
module (`PENDING_FACTORS`, a few MB) until `add_expert_lora` attaches the adapter and copies them in. eora on
experts needs each expert's own routed inputs (`init_expert_lora_` takes them), which the calibration pass does
not collect yet.
"""

import torch

from ..nn import QuantExperts, QuantLinear

EORA_DAMP = 1e-2  # added to the covariance's diagonal, relative to its mean eigenvalue


def _damped_cholesky(matrix: torch.Tensor, damp: float, what: str) -> torch.Tensor:
    """Lower-triangular L with L L^T = the symmetrised `matrix` + damp x its mean eigenvalue on the diagonal (x10,
    x100 where rounding broke positive-definiteness)."""
    m = matrix.detach().float()
    m = (m + m.t()) / 2
    mean = float(torch.diagonal(m).mean())
    floor = mean if mean > 0 else 1.0
    eye = torch.eye(m.shape[0], device=m.device)
    for scale in (damp, 10 * damp, 100 * damp):
        chol, info = torch.linalg.cholesky_ex(m + scale * floor * eye)
        if int(info) == 0:
            return chol
    raise ValueError(f"lora.init eora: the {what} covariance is not positive definite even damped")


def residual_factors(residual: torch.Tensor, r: int, scaling: float, covariance: torch.Tensor | None = None,
                     damp: float = EORA_DAMP, output_covariance: torch.Tensor | None = None,
                     output_damp: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(A fp32 [r, K], B fp32 [N, r]) with scaling * B @ A the best rank-r fit of `residual` [N, K]: in the Frobenius
    norm (loftq), or with `covariance` C [K, K] (the inputs' E[x x^T]) in the activation-weighted norm
    ||(R - s B A) C^(1/2)||_F (eora), and with `output_covariance` G [N, N] too in ||G^(1/2) (R - s B A) C^(1/2)||_F.
    Ranks beyond min(N, K) are zero rows / columns."""
    res = residual.detach().float()
    n, k = res.shape
    chol = out_chol = None
    if covariance is not None:
        chol = _damped_cholesky(covariance.to(res.device), damp, "input")
        res = res @ chol  # R L, C = L L^T
    if output_covariance is not None:
        out_chol = _damped_cholesky(output_covariance.to(res.device), output_damp, "output")
        res = out_chol.t() @ res  # L_G^T R L
    u, sv, vh = torch.linalg.svd(res, full_matrices=False)
    keep = min(r, sv.numel())
    half = sv[:keep].sqrt() / scaling ** 0.5
    b = res.new_zeros(n, r)
    a = res.new_zeros(r, k)
    b_cols = u[:, :keep] * half
    if out_chol is not None:  # L_G^-T b: solve L_G^T X = b (upper triangular)
        b_cols = torch.linalg.solve_triangular(out_chol.t(), b_cols, upper=True)
    b[:, :keep] = b_cols
    a_rows = half[:, None] * vh[:keep]
    if chol is not None:  # a_rows L^-1: solve X L = a_rows (L lower triangular)
        a_rows = torch.linalg.solve_triangular(chol, a_rows, upper=False, left=False)
    a[:keep] = a_rows
    return a, b


@torch.no_grad()
def init_linear_lora_(layer: QuantLinear, weight: torch.Tensor, covariance: torch.Tensor | None = None) -> None:
    """Set `layer`'s adapter (attached, `layer.lora_config.init` loftq or eora) from its 16-bit weight [N, K]:
    the residual against the layer's own dequantized base. eora needs `covariance` [K, K] of the layer's inputs."""
    init = layer.lora_config.init
    if init == "zero" or layer.weight_format == "bf16":
        return
    if init == "eora" and covariance is None:
        raise ValueError("lora.init eora needs the layer's input covariance (calibration text)")
    residual = weight.detach().float() - layer.dequantized_weight(torch.float32).to(weight.device)
    a, b = residual_factors(residual, layer.lora_A.out_features, layer.scaling,
                            covariance if init == "eora" else None)
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
