"""The routers of mixture-of-experts blocks: find them, make them trainable, swap in their original weights.

A sparse-MoE block is a module with an `experts` child and a router child, `gate` (Qwen3-MoE, Qwen2-MoE) or
`router` (gpt-oss). Its router weight is [E, H] (gpt-oss adds a bias [E]); Qwen2-MoE's block also has
`shared_expert_gate`, an nn.Linear(H, 1) whose sigmoid scales the shared expert. These modules' parameters
are the "router" weights qerl can train (`moe.train_router`). By default they stay frozen in the model's dtype.

A trained router keeps an fp32 master weight and computes its logits in fp32 (its input is cast up; the
float outputs other than the logits are cast back to the input's dtype, so the rest of the layer runs as
before). Why fp32: AdamW moves a weight by about lr (1e-5) per step, far below bf16's resolution at the
router's magnitudes (~1e-4 at 0.02), so a bf16 router would not train at all; routing in fp32 is also what
Megatron's `moe_router_dtype=fp32` does for stability. The router logits stay fp32 (the load-balancing loss
reads them). `prepare_routers` applies this to every router and records the original weights, so that a
reference pass can run the base model's routing (`original_routers`).
"""

from contextlib import contextmanager

import torch
from torch import nn

ROUTER_CHILDREN = ("gate", "router")  # the router's attribute name in a sparse-MoE block
SHARED_GATE = "shared_expert_gate"  # Qwen2-MoE: sigmoid gate of the shared expert, nn.Linear(H, 1)
# the PEFT `modules_to_save` entries that name these modules (PEFT matches them as name suffixes)
PEFT_MODULES_TO_SAVE = ("mlp.gate", "mlp.router", SHARED_GATE)
_PREPARED = "_qerl_router_original"  # a prepared router: {parameter: its original tensor} (not in the state dict)


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of every sparse-MoE block: a module with an `experts` child and a router child."""
    return {name: m for name, m in model.named_modules()
            if "experts" in m._modules and any(c in m._modules for c in ROUTER_CHILDREN)}


def router_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of every router weight holder: each block's router and, where present, its shared-expert
    gate, in module order. Each has a 2-D `weight` parameter [E or 1, H]."""
    found = {}
    for name, block in moe_blocks(model).items():
        for child in (*ROUTER_CHILDREN, SHARED_GATE):
            module = block._modules.get(child)
            if module is not None and isinstance(getattr(module, "weight", None), torch.Tensor):
                found[f"{name}.{child}" if name else child] = module
    return found


def routing_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of the top-k routers only (not the shared-expert gates): their forward's first output
    is the router logits [T, E]."""
    return {n: m for n, m in router_modules(model).items() if n.rsplit(".", 1)[-1] in ROUTER_CHILDREN}


def module_parameters(name: str, module: nn.Module) -> dict[str, nn.Parameter]:
    """{state-dict name: parameter} of one router module's own parameters (weight, and a bias where it has one)."""
    return {f"{name}.{p}": t for p, t in module.named_parameters(recurse=False)}


def router_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{state-dict name: parameter} of every prepared router (`prepare_routers`): what an adapter saves."""
    return {k: p for n, m in router_modules(model).items() if hasattr(m, _PREPARED)
            for k, p in module_parameters(n, m).items()}


def _cast_input(module, args, kwargs):
    """Forward pre-hook: the router's input (hidden states [T, H]) cast to fp32, its weight's dtype."""
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        module._qerl_input_dtype = args[0].dtype
        args = (args[0].to(module.weight.dtype), *args[1:])
    return args, kwargs


def _cast_output(module, args, kwargs, output):
    """Forward hook: float outputs back to the input's dtype, except a router's logits (first of a tuple)."""
    dtype = getattr(module, "_qerl_input_dtype", None)
    if dtype is None:
        return output
    if isinstance(output, torch.Tensor):
        return output.to(dtype)
    if isinstance(output, tuple):
        return (output[0], *(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                             for t in output[1:]))
    return output


def prepare_routers(model: nn.Module, trainable: bool | None) -> dict[str, nn.Parameter]:
    """Give every router (`router_modules`) an fp32 master weight computed in fp32 (module docstring) and set
    its requires_grad to `trainable` (None: routers prepared before keep theirs, new ones are frozen); returns
    `router_parameters`. Idempotent: a router already prepared keeps its weight values (e.g. loaded from an
    adapter) and its recorded original. ValueError when the model has no router."""
    routers = router_modules(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router (a block with `experts` and "
                         f"`gate` / `router`); moe.train_router applies to MoE models only")
    for module in routers.values():
        if not hasattr(module, _PREPARED):
            own = dict(module.named_parameters(recurse=False))
            setattr(module, _PREPARED, {p: t.detach().clone() for p, t in own.items()})  # the base's, its dtype
            for p, t in own.items():
                setattr(module, p, nn.Parameter(t.detach().float(), requires_grad=False))
            module.register_forward_pre_hook(_cast_input, with_kwargs=True)
            module.register_forward_hook(_cast_output, with_kwargs=True)
        if trainable is not None:
            module.requires_grad_(trainable)
    return router_parameters(model)


@torch.no_grad()
def reset_routers(model: nn.Module, keep=()) -> None:
    """Put the original (base) weight back into every prepared router whose weight name is not in `keep`."""
    for name, module in router_modules(model).items():
        original = getattr(module, _PREPARED, None)
        if original is not None and not any(k in keep for k in module_parameters(name, module)):
            for p, t in original.items():
                getattr(module, p).copy_(t)


@contextmanager
def original_routers(model: nn.Module):
    """Inside, every prepared router computes with its original (base model) weight: the reference of the KL
    term, like `lora_disabled` for the adapters. The trained weights come back on exit, exceptions included."""
    saved = []  # (parameter, its trained data)
    try:
        for module in router_modules(model).values():
            for p, t in getattr(module, _PREPARED, {}).items():
                param = getattr(module, p)
                saved.append((param, param.data))
                param.data = t.to(param.device, param.dtype)
        yield
    finally:
        for param, data in saved:
            param.data = data
