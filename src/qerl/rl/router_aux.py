"""The mixture-of-experts load-balancing auxiliary loss (Switch Transformer, arXiv 2101.03961, eqs. 4-6), over
the real tokens of one training forward.

For a forward of N real tokens through L MoE layers with E experts and top-k routing, with p_t = softmax of
token t's router logits in layer l and S_t its k most probable experts:

    f_e = (1 / (N L)) sum_{l,t} [e in S_t]        (fraction of top-k assignments, no gradient)
    P_e = (1 / (N L)) sum_{l,t} p_t[e]            (mean router probability, differentiable)
    aux = E * sum_e f_e P_e

pooling all layers' tokens, as transformers' `load_balancing_loss_func` does (tests compare the two); a
perfectly balanced router gives aux = k. Padding is left out by a per-token mask (the padded loss path's
attention mask); the packed path's stream has no padding (each group's prompt once plus the completions).

The router logits are taken by forward hooks on the routers (`capture_router_logits`) rather than through
`output_router_logits`, which qerl keeps off: the hooks see exactly the forward the loss uses, packed or
padded, and are removed before the backward, so gradient checkpointing's recompute records nothing twice.
"""

from contextlib import contextmanager

import torch
from torch import nn

from ..models.router import routing_modules


@contextmanager
def capture_router_logits(model: nn.Module):
    """Inside, each forward of a top-k router appends its logits [T, E] (with their graph) to the yielded list,
    in layer order. ValueError when the model has no router."""
    routers = routing_modules(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router: no load-balancing loss")
    logits: list[torch.Tensor] = []

    def record(module, args, output):
        logits.append(output[0] if isinstance(output, tuple) else output)

    handles = [m.register_forward_hook(record) for m in routers.values()]
    try:
        yield logits
    finally:
        for h in handles:
            h.remove()


def router_top_k(model: nn.Module) -> tuple[int, int]:
    """(E experts, k experts per token) of the model's routers, read from its first router or its config."""
    router = next(iter(routing_modules(model).values()))
    cfg = getattr(model, "config", None)
    experts = getattr(router, "num_experts", None) or getattr(cfg, "num_experts", None) or router.weight.shape[0]
    k = getattr(router, "top_k", None) or getattr(cfg, "num_experts_per_tok", None)
    if k is None:
        raise ValueError(f"{type(model).__name__}: cannot tell how many experts each token uses (top_k)")
    return int(experts), int(k)


def load_balancing_loss(logits: list[torch.Tensor], num_experts: int, top_k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """logits: per MoE layer [N, E] (any float dtype, same N rows each); mask: bool / 0-1 [N] or any shape with
    N elements (e.g. an attention mask [B, S] for N = B * S), True / 1 = a real token; None = all real.
    Returns the fp32 scalar `aux` of the module docstring (0 when no token is real), differentiable through
    the probabilities P_e."""
    if not logits:
        raise ValueError("load_balancing_loss: no router logits")
    device = logits[0].device
    weight = None if mask is None else mask.reshape(-1).to(device, torch.float32)
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)  # sum over layers and tokens
    prob = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer in logits:
        p = layer.float().softmax(-1)  # [N, E]
        chosen = torch.zeros_like(p, dtype=torch.float32).scatter_(
            1, p.detach().topk(top_k, dim=-1).indices, 1.0)  # [N, E] one-hot of the top-k
        if weight is None:
            assigned += chosen.sum(0)
            prob = prob + p.sum(0)
            rows += p.shape[0]
        else:
            if weight.numel() != p.shape[0]:
                raise ValueError(f"load_balancing_loss: mask has {weight.numel()} tokens, the logits {p.shape[0]}")
            assigned += (chosen * weight[:, None]).sum(0)
            prob = prob + (p * weight[:, None]).sum(0)
            rows += weight.sum()
    rows = rows.clamp(min=1)
    return num_experts * ((assigned / rows) * (prob / rows)).sum()
