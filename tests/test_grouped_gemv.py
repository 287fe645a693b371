"""The grouped FP4 decode kernel for mixture-of-experts layers (qerl.kernels.triton.fp4_grouped_gemv) and the routing
to it from `grouped_fp4_linear`, against the plain-torch float64 reference (each expert's rows times its own
dequantized weight), and on the GPU against the tile kernel of `triton.fp4_grouped`.

CPU: the Triton interpreter in a subprocess per suite (tiny shapes); GPU (`-m gpu`): Qwen3-30B-A3B expert shapes
(128 experts, gate_up [1536, 2048], down [2048, 768]) at decode routings, and a CUDA-graph capture replayed on new
routings. Weights are raw random codes and scale bytes (all 16 E2M1 codes forced into every expert, subnormal
scales, zero blocks, an all-zero expert, an expert of maximal scales) with a different global scale per expert
(huge, tiny, ordinary); routings include empty experts, one expert taking every row, experts with more rows than a
chunk, and rows past offsets[-1] (routing sentinels, which must come out 0); every buffer the kernels write is
NaN-filled first, and every output must be finite."""

import pytest
import torch

from kernel_testing import poisoned, require_cuda, run_interpreter_suite
from test_grouped_fp4 import _experts, _reference
from test_kernels_triton import REL_TOL, _rel_err

ALL_CODES = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)  # codes 0..15


def _weights(E: int, n: int, k: int, mx: bool, gen: torch.Generator, special: bool, ordinary: bool = False) -> dict:
    """`test_grouped_fp4._experts` with all 16 codes in the first block of every expert (scale made non-zero); when
    `special` (E >= 3): expert 1 all zero (codes and scales) and expert 2 at its format's largest scales; when
    `ordinary`: no huge or tiny scales (for fp16 outputs)."""
    t = _experts(E, n, k, mx, gen)
    packed, scale = t["weight_packed"], t["weight_scale"].view(torch.uint8)
    packed[:, 0, :8] = ALL_CODES
    scale[:, 0, 0] = 127 if mx else 0x38  # 2^0 / 1.0
    if special and E >= 3:
        packed[1], scale[1] = 0, 0
        # E8M0 200 = 2^73; E4M3 0x7E = 448 (with expert 2's global scale 1e25 NVFP4 stays ordinary-sized, so make
        # it 1e-25 here: weights ~1e27, outputs ~1e29, finite in bf16 and fp32)
        scale[2] = 200 if mx else 0x7E
        if not mx:
            t["weight_global_scale"][2] = 1e-25
    if ordinary:  # fp16 (max 65504): the format's ordinary range only
        if mx:
            scale.clamp_(110, 130)
        else:
            t["weight_global_scale"].fill_(2688.0)
    codes = torch.cat([packed & 15, packed >> 4]).unique()
    assert codes.numel() == 16, "not every E2M1 code is present"
    return t


@poisoned
def _check(device: str, counts: list[int], n: int, k: int, mx: bool, seed: int, config=None, tail: int = 0,
           dtype=torch.bfloat16, special: bool = True, route: bool | None = None) -> list[str]:
    """The decode kernel (or `grouped_fp4_linear` with `GEMV = route` when route is not None) on one routing, with
    `tail` rows past offsets[-1], against the float64 reference; returns the failures as strings."""
    from qerl.kernels.triton import fp4_grouped as triton_fp4_grouped
    from qerl.kernels.triton.fp4_grouped_gemv import grouped_fp4_gemv

    gen = torch.Generator().manual_seed(seed)
    E = len(counts)
    t = _weights(E, n, k, mx, gen, special, ordinary=dtype == torch.float16)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    M = offsets[-1] + tail
    x = torch.randn(M, k, generator=gen).to(dtype)
    ref = _reference(x, offsets, t, mx, False)
    args = (x.to(device), torch.tensor(offsets, device=device), t["weight_packed"].to(device),
            t["weight_scale"].to(device), None if mx else t["weight_global_scale"].to(device), 32 if mx else 16, mx)
    if route is None:
        out = grouped_fp4_gemv(*args, config=config)
    else:
        saved, triton_fp4_grouped.GEMV = triton_fp4_grouped.GEMV, route
        try:
            out = triton_fp4_grouped.grouped_fp4_linear(*args)
        finally:
            triton_fp4_grouped.GEMV = saved
    label = f"{device} counts={counts} tail={tail} n={n} k={k} mx={mx} {dtype} config={config} route={route}"
    if out.shape != ref.shape or out.dtype != dtype:
        return [f"{label}: shape {tuple(out.shape)} {out.dtype} != {tuple(ref.shape)} {dtype}"]
    out = out.cpu()
    if not torch.isfinite(out).all():
        return [f"{label}: non-finite output (NaN: an unwritten element)"]
    fails = []
    if tail and (out[offsets[-1]:] != 0).any():
        fails.append(f"{label}: rows past offsets[-1] are not 0")
    for e, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        if b <= a:
            continue
        if ref[a:b].abs().max() == 0:  # the all-zero expert: exactly 0
            if (out[a:b] != 0).any():
                fails.append(f"{label}: expert {e} (all-zero weights) gives non-zero output")
            continue
        err = _rel_err(out[a:b], ref[a:b])  # per expert: the global scales differ by up to 1e50
        if not err < REL_TOL:
            fails.append(f"{label}: expert {e} rel err {err:.3g}")
    return fails


def suite_nvfp4() -> list[str]:
    """Shapes and routings, NVFP4 (group 16: K only a multiple of 16, so odd word counts)."""
    from qerl.kernels.triton.fp4_grouped_gemv import GroupedGemvConfig as C

    fails = []
    fails += _check("cpu", [3, 0, 5, 1], 24, 48, False, 0, tail=2)  # K8 = 6: not whole 4-word steps
    fails += _check("cpu", [0, 0, 11, 0], 40, 64, False, 1, tail=3)  # one expert takes every row: 2 chunks of 8
    fails += _check("cpu", [0, 0, 11, 0], 40, 64, False, 1, config=C(rows=4))  # 3 chunks, the last short
    fails += _check("cpu", [0, 3, 11, 0], 40, 48, False, 1, config=C(rows=4, skip=False), tail=1)  # no branch
    fails += _check("cpu", [2, 1, 0, 2, 1, 0], 33, 96, False, 2, config=C(bkw=8))  # N odd, 8-word steps, K8 % 8
    fails += _check("cpu", [1, 2, 1], 17, 160, False, 3, config=C(split=3), tail=1)  # split-K (8, 8, 4 words)
    fails += _check("cpu", [2, 0, 3], 24, 48, False, 4, config=C(split=2, bn=32, warps=1))  # split, K8 % 4 != 0
    fails += _check("cpu", [4, 1, 2], 24, 64, False, 5, dtype=torch.float16, special=False)  # fp16
    return fails


def suite_mxfp4() -> list[str]:
    """The same for MXFP4 (group 32: 4 words per scale block)."""
    from qerl.kernels.triton.fp4_grouped_gemv import GroupedGemvConfig as C

    fails = []
    fails += _check("cpu", [3, 0, 5, 1], 24, 64, True, 10, tail=2)
    fails += _check("cpu", [0, 0, 11, 0], 40, 96, True, 11, tail=3)  # K8 = 12 words, one expert, 2 chunks
    fails += _check("cpu", [0, 0, 11, 0], 40, 96, True, 11, config=C(rows=4))
    fails += _check("cpu", [0, 3, 11, 0], 40, 96, True, 11, config=C(rows=4, skip=False), tail=1)
    fails += _check("cpu", [2, 1, 0, 2, 1, 0], 33, 160, True, 12, config=C(bkw=8))  # K8 = 20: not whole 8-word steps
    fails += _check("cpu", [1, 2, 1], 17, 224, True, 13, config=C(split=3), tail=1)  # split-K, K8 = 28
    fails += _check("cpu", [4, 1, 2], 24, 64, True, 15, dtype=torch.float16, special=False)
    return fails


def suite_routing() -> list[str]:
    """`grouped_fp4_linear`'s routing: both kernels forced on the same cases; no rows at all; every row a
    sentinel; QuantExperts' grouped path (forward through the decode kernel, input gradient through the tile
    kernel) against its reference loop."""
    from qerl.kernels.triton import fp4_grouped as triton_fp4_grouped
    from test_grouped_fp4 import _check_experts_module

    fails = []
    for route in (True, False):
        fails += _check("cpu", [3, 0, 5, 1], 24, 48, False, 20, tail=2, route=route)
        fails += _check("cpu", [0, 17, 0], 33, 64, True, 21, tail=1, route=route)
        fails += _check("cpu", [0, 0], 16, 32, False, 22, route=route)  # M = 0
        fails += _check("cpu", [0, 0, 0], 16, 32, True, 23, tail=5, route=route)  # only sentinel rows: all 0
    saved, triton_fp4_grouped.GEMV = triton_fp4_grouped.GEMV, True
    try:
        fails += _check_experts_module("nvfp4") + _check_experts_module("mxfp4")
    finally:
        triton_fp4_grouped.GEMV = saved
    return fails


@pytest.mark.parametrize("suite", ["suite_nvfp4", "suite_mxfp4", "suite_routing"])
def test_interpreter(suite):
    fails = run_interpreter_suite("test_grouped_gemv", suite, timeout=600)
    assert not fails, "\n".join(fails)


def test_routing_rule_uses_host_numbers_and_the_switch():
    from qerl.kernels.triton import fp4_grouped as g

    saved = g.GEMV
    try:
        g.GEMV = None
        per = g.GEMV_MAX_ROWS_PER_EXPERT
        assert g.use_gemv(64, 128) and g.use_gemv(per * 128, 128)  # decode: 8 tokens x top-8 over 128 experts
        assert not g.use_gemv(per * 128 + 1, 128) and not g.use_gemv(0, 128)
        g.GEMV = True
        assert g.use_gemv(10 ** 6, 4)
        g.GEMV = False
        assert not g.use_gemv(1, 128)
    finally:
        g.GEMV = saved


def test_split_and_chunk_choice():
    from qerl.kernels.triton.fp4_grouped_gemv import GroupedGemvConfig, chunk_rows, pick_split

    cfg = GroupedGemvConfig()
    assert chunk_rows(64, 128) == 4 and chunk_rows(512, 128) == 16
    # 1 token x top-8: 8 experts x 12 N blocks is far below 4 waves of 132 SMs: split K (256 words)
    assert pick_split(8, 128, 1536, 256, cfg, 132) > 1
    assert pick_split(512, 128, 1536, 256, cfg, 132) == 1  # every expert busy: no split
    assert pick_split(8, 128, 2048, 2, cfg, 132) == 1  # one step of words: nothing to split
    assert pick_split(8, 128, 2048, 96, GroupedGemvConfig(split=5), 132) == 5


def _decode_routing(tokens: int, E: int, top_k: int, gen: torch.Generator) -> list[int]:
    """Rows per expert of `tokens` tokens each routed to top_k distinct random experts."""
    index = torch.rand(tokens, E, generator=gen).topk(top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(index, minlength=E).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("mx", [False, True], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)], ids=["gate_up", "down"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_real_sizes(tokens, n, k, mx):
    """Qwen3-30B-A3B decode (128 experts, top-8) against the reference, and against the tile kernel."""
    require_cuda()
    from qerl.kernels.triton import fp4_grouped as g

    gen = torch.Generator().manual_seed(tokens + n)
    counts = _decode_routing(tokens, 128, 8, gen)
    fails = _check("cuda", counts, n, k, mx, seed=tokens, tail=3)
    # the two kernels on the same operands, through `grouped_fp4_linear` (the tile kernel rounds W to bf16 before its
    # tensor-core product, the decode kernel multiplies the exact codes and scales in fp32: close, not equal)
    t = _weights(128, n, k, mx, torch.Generator().manual_seed(7), special=True)
    offsets = torch.tensor([0] + counts, device="cuda").cumsum(0)
    x = torch.randn(int(offsets[-1]), k, device="cuda", dtype=torch.bfloat16)
    args = (x, offsets, t["weight_packed"].cuda(), t["weight_scale"].cuda(),
            None if mx else t["weight_global_scale"].cuda(), 32 if mx else 16, mx)
    saved = g.GEMV
    try:
        outs = []
        for route in (True, False):
            g.GEMV = route
            outs.append(g.grouped_fp4_linear(*args).double())
    finally:
        g.GEMV = saved
    bounds = offsets.tolist()
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b > a and outs[1][a:b].abs().max() > 0:
            err = _rel_err(outs[0][a:b], outs[1][a:b])
            if not err < REL_TOL:
                fails.append(f"gemv vs tile kernel tokens={tokens} n={n} k={k} mx={mx} expert {e}: rel diff {err:.3g}")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("mx", [False, True], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("config", [None, "split", "rows4", "noskip", "wide"])
def test_gpu_skewed_and_forced(config, mx):
    """One expert taking all rows (several chunks), forced split-K and small chunks, at the down shape."""
    require_cuda()
    from qerl.kernels.triton.fp4_grouped_gemv import GroupedGemvConfig as C

    cfg = {None: None, "split": C(split=4), "rows4": C(rows=4), "noskip": C(rows=8, skip=False),
           "wide": C(bn=256, bkw=8, warps=4)}[config]
    counts = [0] * 60 + [64] + [0] * 67
    fails = _check("cuda", counts, 2048, 768, mx, seed=3, config=cfg, tail=5)
    fails += _check("cuda", [1, 0, 7, 16, 33, 0, 2, 64], 2048, 768, mx, seed=4, config=cfg, tail=2)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])  # 1 token: split-K with the reduce pass; 8: one pass
def test_gpu_cuda_graph_replays_new_routings(tokens):
    """`grouped_fp4_linear` (routed to the decode kernel) captured once, replayed on new routings and inputs
    written into the captured buffers: equal to the eager call on each (no host read of the routing)."""
    require_cuda()
    from qerl.kernels.triton import fp4_grouped as g

    E, n, k, top_k = 128, 1536, 2048, 8
    t = _weights(E, n, k, False, torch.Generator().manual_seed(1), special=True)
    w = (t["weight_packed"].cuda(), t["weight_scale"].cuda(), t["weight_global_scale"].cuda(), 16, False)
    rows = tokens * top_k
    assert g.use_gemv(rows, E)
    gen = torch.Generator().manual_seed(2)

    def routing():
        counts = _decode_routing(tokens, E, top_k, gen)
        counts[5] = max(0, counts[5] - 1)  # one sentinel row past offsets[-1]
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        return torch.tensor([0] + counts).cumsum(0).cuda(), x.cuda()

    offsets, x = routing()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles the kernels outside the capture
        g.grouped_fp4_linear(x, offsets, *w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.grouped_fp4_linear(x, offsets, *w)
    for _ in range(3):
        new_offsets, new_x = routing()
        offsets.copy_(new_offsets)
        x.copy_(new_x)
        graph.replay()
        want = g.grouped_fp4_linear(x, offsets, *w)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert torch.equal(out, want), "the replay differs from the eager call on the same routing"
        assert (out[int(offsets[-1]):] == 0).all()
