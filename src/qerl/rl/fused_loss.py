"""`optim.fused_loss`: the update's decoder layers as torch.compile regions, so their elementwise chains fuse.

Eager, a decoder layer of the loss pass dispatches each op of RMSNorm, RoPE, SwiGLU, the LoRA A products, B's
scaling and cast and the residual adds one at a time from Python (at 1.5B the pass is bound by that host work).
Inside `compiled_layers(model)` each decoder layer's forward is the compiled form of its class's forward (one
compiled function per class, shared by every layer: the layers differ only in their tensors, which the compiled
graphs take as inputs). What stays outside the graphs:

    the quantized product (`QuantLinear`): an opaque custom op, `qerl.nn.quant_linear_op` (no graph break);
    the packed attention (`qerl.nn.packed_attention`): run eagerly between the graphs, because its layout (buckets
        of segments) differs per micro-batch in number and shapes; one graph break per layer, which Dynamo turns
        into several graphs (the frames it was called through are split too), counted by the tests;
    gradient checkpointing: transformers' checkpoint call wraps the compiled forward (the recompute in the
        backward runs the same compiled graphs).

Shapes: the packed stream's length L changes with every micro-batch, so the layers compile with dynamic shapes
(L symbolic from the first compile; the weights' shapes stay static): one compile per variant (grad mode, LoRA on /
off, train / eval, weight format, whether the layer's input needs a gradient), not one per micro-batch. AQN needs
nothing here: its noise is written into the norm weights outside the forward, and the graphs read the weights as
inputs. The eager layers stay the reference (`optim.fused_loss: false`, the default).
"""

import inspect
from contextlib import contextmanager
from functools import partial

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from ..kernels.route import current_policy
from ..nn.quant_base import QuantizedModule
from ..nn.quant_linear import QuantLinear
from ..nn.quant_linear_op import policy_key

# transformers 5.17 checkpoints in GradientCheckpointingLayer.__call__ (around Module.__call__, so around an
# instance's `forward`); 5.24 wraps each layer class's `forward` in `forward_with_checkpointing` instead
_CALL_CHECKPOINTS = "__call__" in GradientCheckpointingLayer.__dict__
_COMPILED: dict[tuple, object] = {}  # (plain forward, backend) -> its compiled function, shared by every model


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers that can be compiled: transformers' `GradientCheckpointingLayer`s holding no
    quantized module but `QuantLinear` (the 4-bit experts and embeddings have no custom op: a MoE layer stays
    eager)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)
            and all(isinstance(q, QuantLinear) for q in m.modules() if isinstance(q, QuantizedModule))]


def plain_forward(cls: type):
    """The layer class's forward without transformers' checkpointing wrapper (the function to compile)."""
    return inspect.unwrap(cls.forward)


def compiled_forward(cls: type, backend="inductor"):
    """The compiled plain forward of a layer class, called as f(layer, *args, **kwargs); made once per backend.
    dynamic=True: the stream length is symbolic from the first compile (module docstring)."""
    fn = plain_forward(cls)
    key = (fn, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=backend, dynamic=True)
    return _COMPILED[key]


def _fused_forward(layer, compiled):
    """The instance `forward` that runs `compiled` in place of the class's, checkpointing as the class would."""
    if _CALL_CHECKPOINTS:  # GradientCheckpointingLayer.__call__ checkpoints around this forward
        return partial(compiled, layer)

    def forward(*args, **kwargs):  # forward_with_checkpointing's rule, for a loss pass (no cache to drop)
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            return layer._gradient_checkpointing_func(partial(compiled, layer, **kwargs), *args)
        return compiled(layer, *args, **kwargs)

    return forward


@contextmanager
def compiled_layers(model, backend="inductor"):
    """Inside, every decoder layer of `model` (`decoder_layers`) runs its compiled forward; on exit the layers are
    as before (exceptions included). Each QuantLinear in them is pinned to the kernel routing its eager forward
    would take now (its `routing_policy`, else the current scope), so the compiled backward routes the same.
    backend: torch.compile's, a name (`inductor`; `aot_eager` traces and runs the same graphs without generating
    code) or a backend callable."""
    layers = decoder_layers(model)
    linears = [q for layer in layers for q in layer.modules() if isinstance(q, QuantLinear)]
    try:
        for q in linears:
            q.fused_policy_key = policy_key(q.routing_policy or current_policy())
        for layer in layers:
            layer.forward = _fused_forward(layer, compiled_forward(type(layer), backend))
        yield layers
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
        for q in linears:
            q.__dict__.pop("fused_policy_key", None)
