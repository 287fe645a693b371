"""The quantized base product as `torch.library` custom ops, for compiled regions (`optim.fused_loss`).

The eager `quant_linear._QuantizedMatmul` is kept out of Dynamo's tracing: its forward routes through Python policy
objects, context variables (the kernel policy, the dequantization scope) and Triton / Gluon launches chosen at run
time. As an opaque custom op with a shape-only fake implementation, the product is one node of the graph, and the
elementwise code around it (norms, RoPE, SwiGLU, the LoRA A product, B's scaling and cast, residual adds) is
traced and fused by the compiler. The ops run the same entry points as the eager Function
(`quantized_linear`, `quantized_linear_grad_input`), so the compiled and eager paths compute the same products.

    qerl::quantized_matmul(x [..., K], tensors, bias [N] | None, h [..., r] | None, b [N, r] | None, ...)
        -> x @ W^T + bias + h @ b^T, [..., N] in x.dtype
    qerl::quantized_matmul_grad_input(grad [..., N], tensors, ...) -> grad @ W, [..., K] in grad.dtype

b is the LoRA B weight already scaled and cast to x.dtype (traced outside the op, so autograd carries its gradient
back to the fp32 master through the cast and the scaling: the same arithmetic as the eager Function's backward).

The kernel routing: the eager Function takes the layer's `routing_policy`, or the caller's scope at forward time,
and hands it to its backward (autograd's CUDA worker thread does not see the caller's scope). An op argument must
be a plain value, so the policy travels as an int key into `_POLICIES` (`policy_key`); key -1 means the scope
current when the op runs.
"""

import torch

from ..kernels import quantized_linear, quantized_linear_grad_input
from ..kernels.route import KernelPolicy, current_policy, kernel_policy

_POLICIES: list[KernelPolicy] = []  # key -> policy; a run holds one or two, never freed
CURRENT_SCOPE = -1  # the policy key for "the caller's `kernel_policy` scope when the op runs"


def policy_key(policy: KernelPolicy | None) -> int:
    """The int key of `policy` (registered on first use; equal policies share a key), or CURRENT_SCOPE for None."""
    if policy is None:
        return CURRENT_SCOPE
    for i, p in enumerate(_POLICIES):
        if p == policy:
            return i
    _POLICIES.append(policy)
    return len(_POLICIES) - 1


def _policy(key: int) -> KernelPolicy:
    return current_policy() if key == CURRENT_SCOPE else _POLICIES[key]


def _routed(key: int):
    return kernel_policy(_policy(key))


@torch.library.custom_op("qerl::quantized_matmul", mutates_args=())
def quantized_matmul(x: torch.Tensor, tensors: list[torch.Tensor], bias: torch.Tensor | None,
                     h: torch.Tensor | None, b: torch.Tensor | None, fmt: str, names: str,
                     out_features: int, policy: int) -> torch.Tensor:
    """x [..., K] -> x @ W^T + bias (+ h @ b^T), [..., out_features] in x.dtype. tensors: the format's stored
    tensors (uint8 / fp8 / fp32, as `QuantLinear.quantized_tensors`) in the order of `names`, their buffer names
    joined by commas (an op takes no list of strings); h [..., r] and b [N, r] in x.dtype, both or neither;
    policy: a `policy_key`."""
    lora = None if h is None else (h, b)
    with _routed(policy):
        return quantized_linear(fmt, x, dict(zip(names.split(","), tensors)), bias, lora=lora)


@quantized_matmul.register_fake
def _(x, tensors, bias, h, b, fmt, names, out_features, policy):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("qerl::quantized_matmul_grad_input", mutates_args=())
def quantized_matmul_grad_input(grad: torch.Tensor, tensors: list[torch.Tensor], fmt: str, names: str,
                                in_features: int, policy: int) -> torch.Tensor:
    """grad [..., N] -> grad @ W, [..., in_features] in grad.dtype (the input gradient of `quantized_matmul`)."""
    with _routed(policy):
        return quantized_linear_grad_input(fmt, grad, dict(zip(names.split(","), tensors)))


@quantized_matmul_grad_input.register_fake
def _(grad, tensors, fmt, names, in_features, policy):
    return grad.new_empty(*grad.shape[:-1], in_features)


def _setup_context(ctx, inputs, output):
    x, tensors, bias, h, b, fmt, names, out_features, policy = inputs
    ctx.save_for_backward(h, b, *tensors)
    ctx.fmt, ctx.names, ctx.policy, ctx.in_features = fmt, names, policy, x.shape[-1]


def _backward(ctx, grad):
    """grad [..., N] -> (grad_x = grad @ W, grad_h = grad @ b, grad_b = grad^T @ h); never a base gradient."""
    h, b, *tensors = ctx.saved_tensors
    grad_x = grad_h = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = quantized_matmul_grad_input(grad, tensors, ctx.fmt, ctx.names, ctx.in_features, ctx.policy)
    if h is not None:
        g = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[3]:
            grad_h = (g @ b).view(h.shape)
        if ctx.needs_input_grad[4]:
            grad_b = g.t() @ h.reshape(-1, h.shape[-1])
    return grad_x, [None] * len(tensors), None, grad_h, grad_b, None, None, None, None


quantized_matmul.register_autograd(_backward, setup_context=_setup_context)


def compiled_quant_linear(layer, x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """`QuantLinear.forward`'s product under torch.compile: x [..., K], h [..., r] = A(dropout(x)) or None (LoRA off)
    -> [..., N] in x.dtype. The layer's routing comes from its `fused_policy_key` (set by `qerl.rl.fused_loss` for
    the compiled scope), else from the scope the op runs in."""
    b = None
    if h is not None:  # the eager Function's cast, traced: fp32 master times scaling, rounded once to x.dtype
        b = (layer.lora_B.weight.float() * layer.scaling).to(x.dtype)
    key = getattr(layer, "fused_policy_key", CURRENT_SCOPE)
    return quantized_matmul(x, list(layer.quantized_tensors().values()), layer.bias, h, b, layer.weight_format,
                            ",".join(layer._tensor_names), layer.out_features, key)

