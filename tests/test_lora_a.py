"""The one-launch LoRA "A" product h = x @ A^T (`qerl.kernels.lora_a`) against a float64 torch reference.

Each case runs on fresh random inputs with the output filled with NaN first (`workspace.poisoned_outputs`) and
every cached split-K workspace filled with NaN before the call, so an element the kernel forgets to write,
or a partial it reads before it is written, shows up. After each call the arrival counters must be all
zero again (the next launch, e.g. a CUDA graph replay, relies on it) and a second identical call must give
the same bits (the partials are summed in a fixed order). Tolerance: one final rounding of an fp32
accumulation, per element: |h - ref| <= eps(dtype) * |ref| + 1e-5 * (|x| @ |A|^T), plus the global bound
max |h - ref| <= 1e-2 * max |ref| + 1e-3.
Run on the CPU through the Triton interpreter (subprocess) and directly on a GPU (marked gpu), where a
CUDA graph capture replays one call with new inputs.
"""

import sys

import pytest
import torch

from kernel_testing import poisoned, require_cuda, run_interpreter_suite

from qerl.kernels.workspace import capture_graph

# (M, R, K, splits, variant); splits None = the automatic choice; variant: "" plain, "strided" x is a
# column slice of a wider matrix (row stride > K, misaligned start), "special" huge rows and zero rows/cols;
# "/m16" appended: forced 16-row M tiles (several M tiles per R tile, each with its own counter); "/pre": each
# program's K slice as one product with A loaded first (`preload`, what PDL launches use)
INTERP_CASES = [
    (1, 8, 64, 1, ""),
    (3, 48, 1000, 3, "strided"),
    (8, 96, 4096, None, ""),
    (17, 200, 1000, 3, "special"),
    (64, 48, 1000, None, "strided"),
    (1, 200, 4096, 3, ""),
    (17, 8, 4096, None, "special"),
    (64, 96, 64, 3, ""),  # forced 3 splits of a 64-column K: two programs past K add zero partials
    (3, 96, 4096, 1, "special"),
    (8, 48, 1000, None, ""),
    (3, 8, 4096, 3, "strided"),
    (8, 200, 64, None, "special"),
    (64, 200, 4096, 3, "special"),
    (1, 96, 1000, None, "strided"),
    (17, 48, 64, 1, "strided"),
    (64, 8, 1000, 1, ""),
    (64, 48, 1000, 3, "special/m16"),
    (17, 96, 4096, None, "strided/m16"),
    (40, 200, 1000, 1, "/m16"),
    (8, 48, 1000, None, "/pre"),
    (3, 8, 64, 1, "/pre"),
    (17, 48, 1000, 1, "special/pre"),
    (64, 200, 1000, None, "strided/pre"),
    (17, 96, 4096, 3, "special/m16/pre"),
]
GPU_M = (1, 3, 8, 17, 64)
GPU_R = (8, 96, 200)
GPU_K = (64, 1000, 18944)
GPU_SPLITS = (1, 3, None)
GPU_VARIANTS = ("", "strided", "special", "/m16")


def gpu_cases() -> list[tuple]:
    """Every (M, R, K) shape once, with the (split, variant) pair rotating: 45 cases instead of the 540 of the
    full product (which compiled for minutes), and still every pair of factors (M and split, K and variant,
    split and variant, ...) occurs together."""
    shapes = [(M, R, K) for M in GPU_M for R in GPU_R for K in GPU_K]
    pairs = [(s, v) for s in GPU_SPLITS for v in GPU_VARIANTS]
    cases = [shape + pairs[i % len(pairs)] for i, shape in enumerate(shapes)]
    levels = (GPU_M, GPU_R, GPU_K, GPU_SPLITS, GPU_VARIANTS)
    for a in range(5):
        for b in range(a + 1, 5):
            assert len({(c[a], c[b]) for c in cases}) == len(levels[a]) * len(levels[b]), (a, b)
    return cases


def _poison_all():
    """The cached split-K partials start as NaN (outputs do too: `_check_one` runs poisoned)."""
    from qerl.kernels.workspace import persistent_tensors

    for t in persistent_tensors("lora_a"):
        if t.is_floating_point():
            t.fill_(float("nan"))


def _inputs(M, R, K, variant, dtype, device, gen):
    """x [M, K] (maybe a strided column slice), a [R, K] contiguous, both dtype on device."""
    x = torch.randn(M, K + 27, generator=gen, device=device)  # drawn on the device: fast for the GPU grid
    a = torch.randn(R, K, generator=gen, device=device) * 0.1
    if variant == "special":
        huge = 1e15 if dtype == torch.bfloat16 else 30.0  # fp16 max 65504 bounds the result
        x[0, : K // 2] *= huge
        a[R // 2] *= 1e4 if dtype == torch.bfloat16 else 10.0
        if M > 1:
            x[M - 1] = 0  # an all-zero row
        a[0] = 0  # an all-zero column of h
        x[:, 5] = 0
    x, a = x.to(dtype), a.to(dtype)
    x = x[:, 3: 3 + K] if variant == "strided" else x[:, :K].contiguous()
    return x, a


@poisoned
def _check_one(x, a, splits, block_m, tag, call) -> list[str]:
    """One case: `call(x, a, splits, block_m)` against the float64 reference, poisoned, twice."""
    from qerl.kernels.triton import lora_a as triton_lora_a

    M, K = x.shape
    R = a.shape[0]
    ref = x.double() @ a.double().t()
    bound = x.double().abs() @ a.double().abs().t()
    fails = []
    _poison_all()
    h = call(x, a, splits, block_m)
    if h.shape != (M, R) or h.dtype != x.dtype:
        return [f"{tag}: got {tuple(h.shape)} {h.dtype}"]
    if torch.isnan(h).any():
        return [f"{tag}: {torch.isnan(h).sum().item()} NaN elements (unwritten, or unwritten partials read)"]
    err = (h.double() - ref).abs()
    eps = torch.finfo(x.dtype).eps
    tol = eps * ref.abs() + 1e-5 * bound
    if (err > tol).any():
        i = (err - tol).argmax().item()
        fails.append(f"{tag}: {(err > tol).sum().item()} elements off, worst h={h.flatten()[i].item():.6g} "
                     f"ref={ref.flatten()[i].item():.6g}")
    if err.max().item() > 1e-2 * ref.abs().max().item() + 1e-3:
        fails.append(f"{tag}: max error {err.max().item():.3g} for max |ref| {ref.abs().max().item():.3g}")
    cfg = triton_lora_a.config(M, R, K, x.device, splits, block_m=block_m)
    if cfg["splits"] > 1:
        _, cnt = triton_lora_a.buffers(x.device, M, R, cfg["splits"], cfg["BR"], cfg["BM"])
        if cnt.any():
            fails.append(f"{tag}: arrival counters not reset: {cnt.tolist()}")
    _poison_all()
    if not torch.equal(call(x, a, splits, block_m), h):
        fails.append(f"{tag}: a second identical call gave different bits")
    return fails


def _triton_call(x, a, splits, block_m, preload=None):
    from qerl.kernels.triton.lora_a import lora_a_triton

    return lora_a_triton(x, a, splits=splits, block_m=block_m, preload=preload)


def _preload_call(x, a, splits, block_m):
    return _triton_call(x, a, splits, block_m, preload=True)


def _public_call(x, a, splits, block_m):
    from qerl.kernels.lora_a import lora_a

    assert splits is None and block_m is None
    return lora_a(x, a)


def check_lora_a(device: str, dtype=torch.bfloat16, cases=INTERP_CASES, seed: int = 0) -> list[str]:
    """Every case through the kernel; on CUDA the automatic choice goes through the public `lora_a`."""
    fails = []
    gen = torch.Generator(device=device).manual_seed(seed)
    for M, R, K, splits, variant in cases:
        variant, *flags = variant.split("/")
        block_m = 16 if "m16" in flags else None
        x, a = _inputs(M, R, K, variant, dtype, device, gen)
        call = _public_call if (device == "cuda" and splits is None and block_m is None) else _triton_call
        if "pre" in flags:
            call = _preload_call
        tag = f"lora_a {device} {dtype} M={M} R={R} K={K} splits={splits} block_m={block_m} {variant or 'plain'}" \
              f"{' preload' if 'pre' in flags else ''}"
        fails += _check_one(x, a, splits, block_m, tag, call)
    return fails


def interpreter_suite() -> list[str]:
    return check_lora_a("cpu") + check_lora_a("cpu", torch.float16, cases=INTERP_CASES[1:5], seed=1)


def test_interpreter():
    fails = run_interpreter_suite("test_lora_a", timeout=600)
    assert not fails, "\n".join(fails)


def test_config_splits(monkeypatch):
    """The automatic split on an H200-sized GPU (132 SMs): >= MIN_K_PER_SPLIT columns per program, at most 2 programs
    per SM, a tail of at most RED_ROUNDS loads, no empty program; a forced split count is kept."""
    pytest.importorskip("triton")
    from qerl.kernels.triton import lora_a as tla

    monkeypatch.setattr(tla, "_sm_count", lambda device: 132)
    dev = torch.device("cpu")
    for M in (1, 3, 16, 17, 64):
        for R in (8, 48, 64, 96, 256):
            for K in (100, 512, 3584, 18944, 30000):
                cfg = tla.config(M, R, K, dev)
                tiles = cfg["n_r"] * cfg["n_m"]
                assert cfg["k_per"] % cfg["BK"] == 0
                assert (cfg["splits"] - 1) * cfg["k_per"] < K <= cfg["splits"] * cfg["k_per"]
                assert cfg["splits"] == 1 or cfg["k_per"] >= tla.MIN_K_PER_SPLIT
                assert tiles * cfg["splits"] <= max(tiles, tla.PROGRAMS_PER_SM * 132)
                rounds = -(-cfg["splits"] // cfg["SB"])
                assert cfg["SB"] * cfg["RED_M"] * cfg["BR"] <= tla.RED_ELEMS and rounds <= tla.RED_ROUNDS
                assert cfg["BM"] * cfg["n_m"] >= M and cfg["BR"] * cfg["n_r"] >= R
    assert tla.config(1, 64, 18944, dev)["splits"] > 16  # the decode case splits K widely
    assert tla.config(3, 48, 1000, dev, splits=3)["splits"] == 3


def test_cpu_path_is_the_matmul(monkeypatch):
    """Off CUDA, lora_a is exactly x.reshape(-1, K) @ a.t() (the Triton module is not even imported)."""
    from qerl.kernels.lora_a import lora_a

    monkeypatch.setitem(sys.modules, "qerl.kernels.triton.lora_a", None)  # importing it raises
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        wide = torch.randn(2, 3, 200, generator=gen).to(dtype)
        a = torch.randn(24, 160, generator=gen).to(dtype)
        for x in (wide[..., :160], wide[..., 40:].contiguous(), wide[0, :, 7:167]):
            h = lora_a(x, a)
            assert h.shape == (x.numel() // 160, 24)
            assert torch.equal(h, x.reshape(-1, 160) @ a.t())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu(dtype):
    require_cuda()
    fails = check_lora_a("cuda", dtype, cases=gpu_cases(), seed=3)
    assert not fails, "\n".join(fails[:30]) + f"\n({len(fails)} failures)"


@pytest.mark.gpu
def test_gpu_preload_with_programmatic_launch():
    """The preloading form on the GPU, plain and launched with PDL (sm_90+), at the 7B decode shapes where
    the engine uses it (A loaded before the wait for x) and on the interpreter's cases."""
    require_cuda()
    from qerl.kernels import pdl

    cases = [(M, R, K, None, v) for M in (1, 8, 64) for R, K in ((48, 3584), (16, 18944), (32, 3584))
             for v in ("/pre", "special/pre")] + [c for c in INTERP_CASES if c[4].endswith("/pre")]
    fails = check_lora_a("cuda", cases=cases, seed=5)
    with pdl.programmatic_launches(torch.device("cuda")):
        fails += check_lora_a("cuda", cases=cases, seed=6)
    assert not fails, "\n".join(fails[:30]) + f"\n({len(fails)} failures)"


@pytest.mark.gpu
def test_gpu_dispatch(monkeypatch):
    """On CUDA, lora_a takes the kernel for M <= 64 (leading dims flattened), cuBLAS above and when disabled."""
    require_cuda()
    from qerl.kernels import lora_a as la
    from qerl.kernels.triton import lora_a as triton_lora_a

    calls = []
    fn = triton_lora_a.lora_a_triton
    monkeypatch.setattr(triton_lora_a, "lora_a_triton", lambda *a, **k: calls.append(1) or fn(*a, **k))
    gen = torch.Generator().manual_seed(4)
    a = (torch.randn(48, 3584, generator=gen) * 0.1).bfloat16().cuda()
    x = torch.randn(4, 1, 3584, generator=gen).bfloat16().cuda()
    ref = x.reshape(-1, 3584).double() @ a.double().t()
    h = la.lora_a(x, a)
    assert calls == [1] and h.shape == (4, 48)
    torch.testing.assert_close(h.double(), ref, atol=1e-2 * ref.abs().max().item(), rtol=0)
    big = torch.randn(65, 3584, generator=gen).bfloat16().cuda()
    assert torch.equal(la.lora_a(big, a), big @ a.t()) and calls == [1]
    from qerl.kernels.route import kernel_policy

    with kernel_policy(triton=False):
        assert torch.equal(la.lora_a(x, a), x.reshape(-1, 3584) @ a.t()) and calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("M,R,K", [(8, 64, 3584), (3, 96, 18944), (64, 48, 4096)])
def test_gpu_graph_replay(M, R, K):
    """One call captured in a CUDA graph (two, sharing the cached buffers): 20 replays with new x copied into
    the static input, each equal to the reference and bit-identical to an eager call (counters reset)."""
    require_cuda()
    from qerl.kernels.triton import lora_a as triton_lora_a
    from qerl.kernels.lora_a import lora_a

    assert triton_lora_a.config(M, R, K, torch.device("cuda"))["splits"] > 1  # the counter protocol runs
    gen = torch.Generator().manual_seed(5)
    wide = torch.zeros(M, K + 64, dtype=torch.bfloat16, device="cuda")
    x = wide[:, 16: 16 + K]  # static input: a strided column slice, as the engine's activations can be
    a1 = (torch.randn(R, K, generator=gen) * 0.1).bfloat16().cuda()
    a2 = (torch.randn(R, K, generator=gen) * 0.1).bfloat16().cuda()
    x.copy_(torch.randn(M, K, generator=gen))
    graph, (h1, h2) = capture_graph(lambda: (lora_a(x, a1), lora_a(x, a2)))
    for i in range(20):
        x.copy_(torch.randn(M, K, generator=gen) * (1 + i))
        graph.replay()
        torch.cuda.synchronize()
        for h, a in ((h1, a1), (h2, a2)):
            ref = x.double() @ a.double().t()
            err = (h.double() - ref).abs().max().item()
            assert err <= 1e-2 * ref.abs().max().item() + 1e-3, f"replay {i}: max error {err}"
            assert torch.equal(h, lora_a(x, a)), f"replay {i}: differs from an eager call"


@pytest.mark.gpu
def test_gpu_two_streams_keep_their_own_buffers():
    """Split launches of one shape in flight together on two streams: each stream has its own workspace and
    counters, and every result equals the same call run alone (shared counters would let one stream's last
    program sum the other's half-written partials)."""
    require_cuda()
    from qerl.kernels.triton import lora_a as tla

    M, R, K = 8, 64, 3584
    cfg = tla.config(M, R, K, torch.device("cuda"))
    assert cfg["splits"] > 1
    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(M, K, generator=gen).bfloat16().cuda() for _ in range(2)]
    a = (torch.randn(R, K, generator=gen) * 0.1).bfloat16().cuda()
    alone = [tla.lora_a_triton(x, a) for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    bufs = []
    for s in streams:
        with torch.cuda.stream(s):
            bufs.append(tla.buffers(torch.device("cuda"), M, R, cfg["splits"], cfg["BR"], cfg["BM"]))
    assert bufs[0][0].data_ptr() != bufs[1][0].data_ptr() and bufs[0][1].data_ptr() != bufs[1][1].data_ptr()
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(50):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(tla.lora_a_triton(xs[i], a))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(h, alone[i]) for h in outs[i]), f"stream {i}: a result differs from the lone call"
