"""The grouped FP4 kernel for mixture-of-experts layers (qerl.kernels.triton_fp4_grouped) against the
plain-torch float32 reference: each expert's rows times its own dequantized weight.

CPU: the Triton interpreter in a subprocess (small shapes); GPU (`-m gpu`): decode- and prefill-sized
routings at real expert shapes. Weights are raw random codes and scale bytes (all 16 E2M1 codes, subnormal
scales, zero blocks) with a different global scale per expert (huge, tiny, ordinary); routings include
empty experts, one expert taking every row, and counts that are not multiples of a tile; every buffer the
kernel writes is NaN-filled first."""

import pytest
import torch

from kernel_testing import poisoned, require_cuda, run_interpreter_suite
from test_kernels_triton import REL_TOL, _dequant, _random_fp4, _rel_err


def _experts(E: int, n: int, k: int, mx: bool, gen: torch.Generator) -> dict:
    """Stacked per-expert tensors [E, ...] (as QuantExperts stores them), global scales varying by expert."""
    group = 32 if mx else 16
    per = [_random_fp4(n, k, group, mx, gen, (2688.0, 1e-25, 1e25, 700.0)[e % 4]) for e in range(E)]
    out = {name: torch.stack([t[name] for t in per]) for name in per[0]}
    if not mx:
        out["weight_global_scale"] = out["weight_global_scale"].view(E, 1)
    return out


def _reference(x: torch.Tensor, offsets: list[int], tensors: dict, mx: bool) -> torch.Tensor:
    out = torch.zeros(x.shape[0], tensors["weight_packed"].shape[1], dtype=torch.float64)
    for e in range(len(offsets) - 1):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            w = _dequant({name: t[e] for name, t in tensors.items()}, mx).double()
            out[a:b] = x[a:b].double() @ w.T
    return out


@poisoned
def _check(device: str, counts: list[int], n: int, k: int, mx: bool, seed: int) -> list[str]:
    from qerl.kernels.triton_fp4_grouped import grouped_fp4_linear

    gen = torch.Generator().manual_seed(seed)
    E = len(counts)
    tensors = _experts(E, n, k, mx, gen)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    x = torch.randn(offsets[-1], k, generator=gen).to(torch.bfloat16)
    ref = _reference(x, offsets, tensors, mx)
    out = grouped_fp4_linear(x.to(device), offsets, tensors["weight_packed"].to(device),
                             tensors["weight_scale"].to(device),
                             None if mx else tensors["weight_global_scale"].to(device), 32 if mx else 16, mx)
    label = f"{device} counts={counts} n={n} k={k} mx={mx}"
    if out.shape != ref.shape:
        return [f"{label}: shape {tuple(out.shape)} != {tuple(ref.shape)}"]
    if torch.isnan(out).any():
        return [f"{label}: NaN (an unwritten element)"]
    err = _rel_err(out, ref) if offsets[-1] else 0.0
    return [f"{label}: rel err {err:.3g}"] if err > REL_TOL else []


CPU_CASES = [  # (rows per expert, N, K)
    ([3, 0, 5, 1], 24, 48),  # an empty expert, odd counts
    ([0, 17, 0], 33, 64),  # one expert takes every row (more than one 16-row tile), N not a tile multiple
    ([2, 2, 2, 2, 2], 40, 160),  # K not a multiple of the 128-column tile
    ([0, 0], 16, 32),  # no rows at all
]


def interpreter_suite() -> list[str]:
    fails = []
    for i, (counts, n, k) in enumerate(CPU_CASES):
        for mx in (False, True):
            if mx and k % 32:
                continue
            fails += _check("cpu", counts, n, k, mx, seed=i)
    return fails


def test_interpreter():
    fails = run_interpreter_suite("test_grouped_fp4", timeout=600)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("mx", [False, True], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("counts,n,k", [
    ([4] * 32 + [0] * 32, 1536, 2048),  # decode: 128 tokens x top-8 over 64 of 128 experts (gate_up shape)
    ([1, 0, 7, 16, 33, 0, 2, 64], 2048, 768),  # down shape, ragged
    ([0, 300, 0, 5], 256, 512),  # one expert takes nearly all
])
def test_gpu(counts, n, k, mx):
    require_cuda()
    fails = _check("cuda", counts, n, k, mx, seed=sum(counts))
    assert not fails, "\n".join(fails)
