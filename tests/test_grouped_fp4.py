"""The grouped FP4 kernels for mixture-of-experts layers (qerl.kernels.triton.fp4_grouped), forward and input
gradient, against the plain-torch float64 reference: each expert's rows times its own dequantized weight.

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


def _reference(x: torch.Tensor, offsets: list[int], tensors: dict, mx: bool, grad_input: bool) -> torch.Tensor:
    """Forward: row r of x [M, K] times W_e^T; grad_input: row r of g [M, N] times W_e; float64."""
    n, k = tensors["weight_packed"].shape[1], 2 * tensors["weight_packed"].shape[2]
    out = torch.zeros(x.shape[0], k if grad_input else n, dtype=torch.float64)
    for e in range(len(offsets) - 1):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            w = _dequant({name: t[e] for name, t in tensors.items()}, mx).double()
            out[a:b] = x[a:b].double() @ (w if grad_input else w.T)
    return out


@poisoned
def _check(device: str, counts: list[int], n: int, k: int, mx: bool, seed: int) -> list[str]:
    """The forward and the input gradient of one routing against the float64 reference."""
    from qerl.kernels.triton.fp4_grouped import grouped_fp4_grad_input, grouped_fp4_linear

    gen = torch.Generator().manual_seed(seed)
    E = len(counts)
    tensors = _experts(E, n, k, mx, gen)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    weights = (tensors["weight_packed"].to(device), tensors["weight_scale"].to(device),
               None if mx else tensors["weight_global_scale"].to(device), 32 if mx else 16, mx)
    fails = []
    for grad_input, fn, width in ((False, grouped_fp4_linear, k), (True, grouped_fp4_grad_input, n)):
        x = torch.randn(offsets[-1], width, generator=gen).to(torch.bfloat16)
        ref = _reference(x, offsets, tensors, mx, grad_input)
        out = fn(x.to(device), torch.tensor(offsets, device=device), *weights)
        label = f"{device} {fn.__name__} counts={counts} n={n} k={k} mx={mx}"
        if out.shape != ref.shape:
            fails.append(f"{label}: shape {tuple(out.shape)} != {tuple(ref.shape)}")
        elif torch.isnan(out).any():
            fails.append(f"{label}: NaN (an unwritten element)")
        else:  # per expert: the global scales differ by up to 1e50, so one expert's error must not hide in another's
            errs = [_rel_err(out[a:b], ref[a:b]) for a, b in zip(offsets[:-1], offsets[1:]) if b > a]
            if errs and max(errs) > REL_TOL:
                fails.append(f"{label}: rel err {max(errs):.3g} (worst expert)")
    return fails


CPU_CASES = [  # (rows per expert, N, K)
    ([3, 0, 5, 1], 24, 48),  # an empty expert, odd counts
    ([0, 17, 0], 33, 64),  # one expert takes every row (more than one 16-row tile), N not a tile multiple
    ([2, 2, 2, 2, 2], 40, 160),  # K not a multiple of the 128-column tile
    ([20, 0, 9], 64, 96),  # N a whole 64-row tile (no row masks in the gradient's reduction)
    ([0, 0], 16, 32),  # no rows at all
]


def _check_experts_module(fmt: str) -> list[str]:
    """QuantExperts' grouped path through the kernels (forward and input gradient, bf16 on the CPU in the
    interpreter) against its reference loop: outputs and the gradients of hidden states and routing weights; the
    two products and their gradients share one tile table."""
    from test_quant_experts import _model

    from qerl.nn.quant_experts import QuantExperts

    torch.manual_seed(5)
    quant = QuantExperts.from_experts(_model().model.layers[0].mlp.experts, fmt)
    T, k, E, H = 40, 2, quant.num_experts, quant.hidden_dim
    index = torch.randint(0, E, (T, k))
    index[3, 0] = index[17, 1] = E  # expert-parallel sentinels: skipped, in the output and in the gradients
    from qerl.kernels.triton import fp4_grouped as triton_fp4_grouped

    builds, build = [], triton_fp4_grouped.tile_table
    triton_fp4_grouped.tile_table = lambda *a: builds.append(1) or build(*a)  # count the tables built
    results = []
    for linear in (quant._kernel_linear, None):
        hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).requires_grad_()
        weights = torch.rand(T, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).requires_grad_()
        out = (quant.grouped_forward(hidden, index, weights, linear) if linear
               else quant.reference_forward(hidden, index, weights))
        out.float().square().sum().backward()
        results.append((out.detach(), hidden.grad, weights.grad))
    triton_fp4_grouped.tile_table = build
    fails = [] if len(builds) == 1 else [f"QuantExperts {fmt}: {len(builds)} tile tables for one routing (want 1)"]
    for name, got, want in zip(("output", "grad hidden", "grad routing weights"), *results):
        err = _rel_err(got, want.double())
        if err > 2e-2:
            fails.append(f"QuantExperts {fmt} grouped vs reference {name}: rel err {err:.3g}")
    return fails


def interpreter_suite() -> list[str]:
    fails = _check_experts_module("nvfp4") + _check_experts_module("mxfp4")
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


def test_tile_table_covers_every_row_once_in_a_fixed_size():
    """The device-built table: each expert's rows in bm-row tiles, in order, then empty slots; its size depends
    only on the shapes (E + rows / bm), never on the routing."""
    from qerl.kernels.triton.fp4_grouped import tile_table

    for counts, bm in (([3, 0, 17, 1, 0], 16), ([0, 0, 0], 16), ([40, 40], 32), ([5] * 8, 64)):
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        slots = len(counts) + -(-max(offsets[-1], 1) // bm)
        experts, firsts, ends = tile_table(torch.tensor(offsets), bm, slots)
        assert experts.shape == firsts.shape == ends.shape == (slots,)
        want = [(e, r, offsets[e + 1]) for e in range(len(counts)) for r in range(offsets[e], offsets[e + 1], bm)]
        got = list(zip(experts.tolist(), firsts.tolist(), ends.tolist()))
        assert got[:len(want)] == want, counts
        assert all(f >= e for _, f, e in got[len(want):]), "a slot past the needed tiles is not empty"
