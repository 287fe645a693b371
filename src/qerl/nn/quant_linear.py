"""A linear layer with a frozen quantized base weight and a trainable LoRA adapter.

    y = x @ W^T + bias + scaling * B(A(dropout(x)))

W is held only in its storage format (e.g. NVFP4 packed + scales), as buffers named like the
checkpoint (`weight_packed`, `weight_scale`, `weight_global_scale`), so `state_dict()` is directly a
compressed-tensors module state. LoRA parameters are `lora_A.weight` [r, K] and `lora_B.weight` [N, r]
(PEFT's names). Autograd: the gradient reaches the input and the LoRA parameters, never the base; the
backward recomputes x-gradients from the 4-bit tensors instead of saving a 16-bit W.
"""

from contextlib import nullcontext

import torch
from torch import nn

from ..formats import WeightFormat, get_format
from ..kernels import quantized_linear, quantized_linear_grad_input
from ..kernels.route import KernelPolicy, current_policy, kernel_policy
from .lora import LoraConfig, init_lora_, lora_hidden
from .quant_base import QuantizedModule


def _routed_by(policy: KernelPolicy):
    """A scope routing by `policy`; nothing to enter when it is already the current one (the common case)."""
    return nullcontext() if policy is current_policy() else kernel_policy(policy)


class _QuantizedMatmul(torch.autograd.Function):
    """x [..., K] -> x @ W^T + bias (+ scaling * h @ B^T); backward gives grad_x = grad_y @ W and, with the
    LoRA term, grad_h = scaling * grad_y @ B and grad_B = scaling * grad_y^T @ h -- never a base gradient.

    The LoRA term is the matmul's own epilogue (one addmm into the fresh base output, `add_lora`): as
    separate ops, B's product, the scaling and the add would each be a full pass over the [M, N] output
    (three of them per linear, at training sizes ~8% of a 7B forward).
    h [..., r] = A(dropout(x)) in x.dtype stays outside (plain autograd carries its gradient to A and x);
    b_weight is lora_B.weight [N, r] (the fp32 master), scaled and cast here once per call.
    policy: the kernel routing for both products (None: the caller's `kernel_policy` scope). The backward runs it
    explicitly: on CUDA autograd calls backward on a worker thread, which does not see the caller's scope."""

    @staticmethod
    def forward(ctx, x, fmt, names, bias, h, b_weight, scaling, policy, *tensors):
        ctx.fmt, ctx.names, ctx.scaling = fmt, names, scaling
        ctx.policy = policy if policy is not None else current_policy()
        ctx.b_dtype = None if b_weight is None else b_weight.dtype
        b = None if h is None else (b_weight.float() * scaling).to(x.dtype)  # [N, r], as the rollout engine's
        ctx.save_for_backward(h, b, *tensors)
        with _routed_by(ctx.policy):
            return quantized_linear(fmt, x, dict(zip(names, tensors)), bias, lora=None if h is None else (h, b))

    @staticmethod
    def backward(ctx, grad_out):
        h, b, *tensors = ctx.saved_tensors
        grad_x = grad_h = grad_b = None
        if ctx.needs_input_grad[0]:
            with _routed_by(ctx.policy):
                grad_x = quantized_linear_grad_input(ctx.fmt, grad_out, dict(zip(ctx.names, tensors)))
        if h is not None:
            g = grad_out.reshape(-1, grad_out.shape[-1])
            if ctx.needs_input_grad[4]:
                grad_h = (g @ b).view(h.shape)
            if ctx.needs_input_grad[5]:  # scaling * g^T h for the fp32 master, as the cast's backward gives
                grad_b = (g.t() @ h.reshape(-1, h.shape[-1])).float().mul_(ctx.scaling).to(ctx.b_dtype)
        return (grad_x, None, None, None, grad_h, grad_b, None, None) + (None,) * len(ctx.names)


class QuantLinear(QuantizedModule):
    """Frozen quantized base + LoRA. Build with `QuantLinear.from_linear(linear, fmt, lora)`."""

    carries_lora = True

    def __init__(self, in_features: int, out_features: int, fmt: str | WeightFormat, tensors: dict[str, torch.Tensor],
                 bias: torch.Tensor | None = None, lora: LoraConfig | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_format = get_format(fmt).name
        self._tensor_names = tuple(tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.lora_enabled = True
        # the kernel routing of this layer's products, forward and backward; None: the caller's `kernel_policy`
        # scope at forward time (which a gradient-checkpointing recompute on an autograd worker does not see)
        self.routing_policy: KernelPolicy | None = None
        self.lora_A = self.lora_B = self.lora_config = None
        if lora is not None:
            self.add_lora(lora)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str | WeightFormat, lora: LoraConfig | None = None,
                    global_scale: torch.Tensor | None = None) -> "QuantLinear":
        tensors = get_format(fmt).quantize(linear.weight, global_scale)
        return cls(linear.in_features, linear.out_features, fmt, tensors, linear.bias, lora)

    def add_lora(self, lora: LoraConfig) -> None:
        device = self.quantized_tensors()[self._tensor_names[0]].device
        self.lora_A = nn.Linear(self.in_features, lora.r, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(lora.r, self.out_features, bias=False, device=device, dtype=torch.float32)
        init_lora_(self.lora_A, self.lora_B)
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
        self.lora_config = lora
        self.scaling = lora.scaling

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The base weight W [N, K] as a new dense tensor (for export and tests; not used in forward)."""
        return get_format(self.weight_format).dequantize(**self.quantized_tensors(), dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], in x.dtype."""
        h = b = None
        scaling = 1.0
        if self.lora_A is not None and self.lora_enabled:
            h = lora_hidden(x, self.lora_A, self.lora_dropout)
            b, scaling = self.lora_B.weight, self.scaling
        return _QuantizedMatmul.apply(x, self.weight_format, self._tensor_names, self.bias, h, b, scaling,
                                      self.routing_policy, *self.quantized_tensors().values())

    def extra_repr(self) -> str:
        r = self.lora_A.out_features if self.lora_A is not None else 0
        return f"in={self.in_features}, out={self.out_features}, format={self.weight_format}, lora_r={r}"


def set_routing_policy(model: nn.Module, policy: KernelPolicy | None) -> int:
    """Give every QuantLinear of `model` this kernel routing for its forward and backward products (None: back
    to the caller's scope); returns how many layers took it. Unlike a `kernel_policy` scope around training it
    also holds in backward passes and gradient-checkpointing recomputes that autograd runs on worker threads."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.routing_policy = policy
    return len(layers)
