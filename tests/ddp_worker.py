"""Worker for tests/test_distributed.py: one data-parallel policy update on a fixed batch (gloo, CPU)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from tiny import tiny_model  # noqa: E402

from qerl.models import lora_parameters, quantize_model  # noqa: E402
from qerl.nn import LoraConfig  # noqa: E402
from qerl.rl.collect import Experience  # noqa: E402
from qerl.rl.distributed import DistContext  # noqa: E402
from qerl.rl.losses import LossSettings  # noqa: E402
from qerl.rl.update import UpdateSettings, policy_update  # noqa: E402


def fixed_batch(n: int = 8) -> Experience:
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([6, 3, 5, 1, 6, 4, 2, 6])[:n]
    mask = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)
    return Experience(
        prompt_ids=torch.randint(3, 150, (n, 5), generator=g), prompt_mask=torch.ones(n, 5, dtype=torch.bool),
        completion_ids=torch.randint(3, 150, (n, 6), generator=g), completion_mask=mask,
        sampling_logp=torch.zeros(n, 6), entropies=torch.zeros(n, 6), rewards=torch.zeros(n),
        advantages=torch.randn(n, generator=g), lengths=lengths, truncated=torch.zeros(n, dtype=torch.bool))


def rows(exp: Experience, idx) -> Experience:
    return Experience(*(getattr(exp, f)[idx] for f in ("prompt_ids", "prompt_mask", "completion_ids",
                                                        "completion_mask", "sampling_logp", "entropies", "rewards",
                                                        "advantages", "lengths", "truncated")))


def policy_with_adapter():
    """The same tiny NVFP4 model with a non-zero adapter on every rank (fixed seeds)."""
    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8))
    params = lora_parameters(model)
    with torch.no_grad():
        for p in params.values():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    return model, params


def run_update(exp: Experience, algo: str, ctx: DistContext) -> dict[str, torch.Tensor]:
    model, params = policy_with_adapter()
    opt = torch.optim.SGD(params.values(), lr=0.1)
    settings = UpdateSettings(LossSettings(algo, 0.2, 0.28, 0.0, 6), num_updates=2, micro_batch_size=3,
                              max_grad_norm=1e9, tis_cap=None)
    policy_update(model, exp, opt, list(params.values()), settings, dist_ctx=ctx)
    return {k: v.detach().clone() for k, v in params.items()}


def main(rank: int, world: int, port: int, out: str, algo: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    exp = fixed_batch()
    mine = rows(exp, torch.arange(rank, len(exp.rewards), world))  # interleaved shares, as the trainer does
    result = run_update(mine, algo, DistContext(rank, world, 0, "cpu"))
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
