"""Data-parallel training with torch.distributed: `torchrun --nproc-per-node N -m qerl.cli train ...`.

Every rank holds the whole quantized model and draws the same global batch of prompts from an identical
prompt stream, keeping its own slice (rank r takes prompts r, r+N, ...); it samples, scores and computes
the loss of its slice only. The loss normaliser is the one of the GLOBAL batch (rows / tokens summed over
ranks), so summing the LoRA gradients over ranks (one all-reduce per optimizer step) gives exactly the
single-process gradient of the union batch. Rank 0 writes metrics, checkpoints and the adapter. Multi-node
is the same code path (torchrun's --nnodes / --rdzv-endpoint); NCCL on GPUs, gloo on CPUs.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"  # where collectives' tensors live (CUDA for NCCL)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistContext:
    """Join the process group torchrun describes in the environment (WORLD_SIZE > 1); else single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend)
    where = f"cuda:{local_rank}" if device.type == "cuda" else "cpu"
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, where)


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks in place (identity in a single process)."""
    if ctx.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_gradients(params: list[torch.Tensor], ctx: DistContext) -> None:
    """Sum the gradients of `params` over ranks in one collective (a flat buffer, not one call per tensor)."""
    if not ctx.enabled:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def mean_metrics(metrics: dict, ctx: DistContext) -> dict:
    """Numeric metrics averaged over ranks (one collective); every rank gets the same dict."""
    if not ctx.enabled:
        return metrics
    keys = [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"]
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return {**metrics, **{k: v / ctx.world for k, v in zip(keys, values.tolist())}}


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()
