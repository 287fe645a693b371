"""The W4A8 path of model.compute fp8 against plain torch:
  - per-token activation quantization (`qerl.kernels.triton.w4a8.quantize_rows_e4m3`): bit-identical to
    `quantize_rows_fp8` (torch's own e4m3 cast);
  - the decode of NVFP4 / MXFP4 to e4m3 (`fp4_to_e4m3`): bit-identical to `nvfp4_as_fp8` / `mxfp4_as_fp8`, on all
    16 codes, zero, tiny and huge blocks, all-zero rows, odd shapes;
  - the product (`qerl.kernels.fp8_matmul.w4a8_linear`, GPU): against the float64 product of the same quantized
    operands; NaN in x reaches its output row; the dispatch's row threshold.
The kernels run on the CPU through the Triton interpreter (a subprocess, `kernel_testing.run_interpreter_suite`);
on sm_89+ GPUs the same checks meet the hardware's conversions and FP8 tensor cores."""

import pytest
import torch

from kernel_testing import poisoned, require_cuda, run_interpreter_suite

from qerl.formats.fp8 import fp4_row_shift, mxfp4_as_fp8, nvfp4_as_fp8, quantize_rows_fp8
from qerl.formats.fp4 import pack_fp4
from qerl.formats.mxfp4 import quantize_mxfp4
from qerl.formats.nvfp4 import quantize_nvfp4
from qerl.kernels.operands import scale_bytes

AS_FP8 = {"nvfp4": nvfp4_as_fp8, "mxfp4": mxfp4_as_fp8}


def _activations(m: int, k: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Rows spanning 12 decades (fp16's top ones overflow to inf: rows of NaN codes, as torch makes them), an
    all-zero row, a row with e4m3-subnormal ratios and exact ties."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g) * torch.logspace(-6, 6, m, device=device)[:, None]
    if m > 3:
        x[1] = 0
        x[2, :6] = torch.tensor([448.0, 2 ** -7, -(2 ** -10), 17.0, 19.0, 1.0625], device=device)
        x[2, 6:] = x[2, 6:].clamp(-1, 1)
    return x.to(dtype)


def _weights(fmt: str, n: int, k: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """A 4-bit weight whose rows span 8 decades, with an all-zero row, a zero block, a huge block, and (NVFP4) the
    16 codes in every block of row 3 under random scales, tiny subnormal ones included."""
    g = torch.Generator(device).manual_seed(seed)
    w = torch.randn(n, k, device=device, generator=g) * torch.logspace(-4, 4, n, device=device)[:, None]
    w[0] = 0
    w[2, :32] = 0
    w[2, 32:64] *= 1e6
    t = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_mxfp4(w)
    if fmt == "nvfp4" and n > 4:
        codes = torch.arange(k, device=device, dtype=torch.uint8) % 16
        t["weight_packed"][3] = pack_fp4(codes[None])[0]
        raw = torch.randint(1, 127, (k // 16,), device=device, generator=g, dtype=torch.uint8)
        raw[:3] = torch.tensor([1, 2, 126], dtype=torch.uint8)  # the smallest subnormal, another, the largest
        t["weight_scale"][3] = raw.view(torch.float8_e4m3fn)
    return t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal e4m3 bits, every NaN (0x7F or 0xFF) counted equal."""
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.uint8)[~nan_a], b.view(torch.uint8)[~nan_b])


def check_quantize_rows(device: str) -> list[str]:
    from qerl.kernels.triton.w4a8 import quantize_rows_e4m3

    fails = []
    for m, k, dtype in [(9, 200, torch.float32), (5, 4100, torch.bfloat16), (8, 3584, torch.float16),
                        (1, 16, torch.float32)]:
        x = _activations(m, k, dtype, device, m + k)
        q, s = poisoned(quantize_rows_e4m3)(x)
        rq, rs = quantize_rows_fp8(x)
        if not (_same_bits(q, rq) and torch.equal(s, rs)):
            fails.append(f"quantize rows {m}x{k} {dtype}: codes differ, scales equal {torch.equal(s, rs)}")
    return fails


def check_decode(device: str) -> list[str]:
    from qerl.kernels.triton.w4a8 import fp4_to_e4m3

    fails = []
    for fmt, n, k in [("nvfp4", 70, 256), ("nvfp4", 33, 272), ("mxfp4", 40, 320)]:
        t = _weights(fmt, n, k, device, n)
        ref = AS_FP8[fmt](**t)
        d = poisoned(fp4_to_e4m3)(t["weight_packed"], scale_bytes(t["weight_scale"]),
                                  fp4_row_shift(fmt, t["weight_scale"]), fmt == "mxfp4")
        if not _same_bits(d, ref["weight"]):
            fails.append(f"decode {fmt} {n}x{k}: codes differ")
    return fails


def _reference(xq, xs, f: dict) -> torch.Tensor:
    return (xq.double() * xs.double()) @ (f["weight"].double() * f["weight_scale"].double()).t()


def scaled_mm_tolerance(xq, xs, f: dict, ref: torch.Tensor, out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `_scaled_mm` on sm_90 may differ from the float64 product ref (bias included) by: the product's rounding
    to out_dtype and the bias add's, plus the FP8 tensor cores' accumulation, whose error scales with the sum of the
    terms' magnitudes sum_k |x_k w_k| (their partial sums keep fewer than fp32's 24 bits): 2^-13 of that sum."""
    terms = (xq.double().abs() * xs.double()) @ (f["weight"].double().abs() * f["weight_scale"].double()).t()
    product = ref if bias is None else ref - bias.double()
    return 2 ** -8 * (product.abs() + (0 if bias is None else ref.abs())) + 2 ** -13 * terms


def check_product(device: str, cases) -> list[str]:
    from qerl.kernels.fp8_matmul import w4a8_linear

    fails = []
    for fmt, m, n, k, bias, dtype in cases:
        t = _weights(fmt, n, k, device, m + n)
        x = _activations(m, k, dtype, device, k)
        x[0, 7] = float("nan")
        b = torch.randn(n, device=device).to(dtype) if bias else None
        y = poisoned(w4a8_linear)(fmt, x, t, b)
        q, s = quantize_rows_fp8(x)
        ref = _reference(q, s, AS_FP8[fmt](**t)) + (0 if b is None else b.double())
        if not torch.isnan(y[0]).all():
            fails.append(f"{fmt} {m}x{n}x{k}: NaN in x did not reach its output row")
        tol = scaled_mm_tolerance(q, s, AS_FP8[fmt](**t), ref, dtype, b)[1:]
        y, ref = y[1:].double(), ref[1:]
        finite = torch.isfinite(ref).all(dim=1)  # fp16 rows that overflowed to inf are NaN on both sides
        if not torch.equal(torch.isfinite(y).all(dim=1), finite):
            fails.append(f"{fmt} {m}x{n}x{k}: non-finite rows differ from the reference's")
        err = (y[finite] - ref[finite]).abs()
        if (err > tol[finite]).any():
            fails.append(f"{fmt} {m}x{n}x{k} bias={bias} {dtype}: max err / tolerance "
                         f"{float((err / tol[finite])[tol[finite] > 0].max()):.3g}")
    return fails


def interpreter_suite() -> list[str]:
    """All CPU checks; run in a subprocess with TRITON_INTERPRET=1 (see `test_interpreter`)."""
    return check_quantize_rows("cpu") + check_decode("cpu")


def test_interpreter():
    fails = run_interpreter_suite("test_w4a8_kernel", timeout=600)
    assert not fails, "\n".join(fails)


def test_row_shift_puts_the_row_maximum_in_e4m3s_top_binade():
    """6 x the largest block scale / shift lands in (224, 448] for every nonzero row (exactly 448 when that bound
    is a power of two times 448), 1 for all-zero scales, never below 2^-126 (the kernels multiply by 1 / shift)."""
    # NVFP4's one global scale spans the tensor, its E4M3 block scales ~2^17 below it; MXFP4's scales 2^254
    for fmt, quantize, decades in (("nvfp4", quantize_nvfp4, 2), ("mxfp4", quantize_mxfp4, 30)):
        w = torch.randn(64, 256) * torch.logspace(-decades, decades, 64)[:, None]
        w[0] = 0
        t = quantize(w)
        shift = fp4_row_shift(fmt, t["weight_scale"])
        f = AS_FP8[fmt](**t)
        top = f["weight"].float().abs().amax(dim=1)
        assert (f["weight"][0].float() == 0).all() and (shift >= 2 ** -126).all()
        rows = (shift[:, 0] > 2 ** -126) & (top > 0)  # the rows the clamp left alone
        assert rows.sum() > 40 and (top[rows] > 224).all() and (top <= 448).all(), fmt
    s = torch.full((2, 4), 448.0 / 6 * 4).to(torch.float8_e4m3fn)  # bound = 4 exactly: shift 4, not 8
    assert fp4_row_shift("nvfp4", s).flatten().tolist() == [4.0, 4.0]
    assert fp4_row_shift("nvfp4", torch.zeros(1, 4).to(torch.float8_e4m3fn)).item() == 1


def test_row_shifts_stay_at_one_address_and_follow_the_scales():
    """`w4a8_shift` keeps each weight's shifts in fixed tensors (a captured CUDA graph reads them): a new view of
    the same scales (the engine's fused sibling groups, rebuilt on every refresh) gets the same tensors; scales or a
    global scale changed in place are recomputed into them; the values always equal a fresh computation."""
    from qerl.kernels.fp8_matmul import w4a8_shift

    for fmt, quantize in (("nvfp4", quantize_nvfp4), ("mxfp4", quantize_mxfp4)):
        t = quantize(torch.randn(48, 256) * torch.logspace(-2, 2, 48)[:, None])

        def fresh(tensors):
            shift = fp4_row_shift(fmt, tensors["weight_scale"])
            return shift, shift / tensors["weight_global_scale"] if fmt == "nvfp4" else shift

        shift, ws = w4a8_shift(fmt, t)
        assert all(torch.equal(a, b) for a, b in zip((shift, ws), fresh(t)))
        scale = t["weight_scale"]
        view = {**t, "weight_scale": scale.as_strided(scale.shape, scale.stride())}  # another object, same memory
        again = w4a8_shift(fmt, view)
        assert again[0] is shift and again[1] is ws
        with torch.no_grad():  # an in-place load of other scales: same tensors, new values
            scale[5] = scale[40]
            if fmt == "nvfp4":
                t["weight_global_scale"].mul_(2)
        now = w4a8_shift(fmt, view)
        assert now[0] is shift and now[1] is ws
        assert all(torch.equal(a, b) for a, b in zip(now, fresh(view))), fmt


# ---- GPU ----

def _fp8_gpu():
    require_cuda()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or newer")


@pytest.mark.gpu
def test_gpu_conversions_are_bit_identical_to_torch():
    """The hardware's fp32 -> e4m3 conversion (cvt.rn.satfinite) rounds as torch's cast does."""
    _fp8_gpu()
    fails = check_quantize_rows("cuda") + check_decode("cuda")
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_gpu_product_against_float64():
    _fp8_gpu()
    cases = [("nvfp4", m, n, k, bias, torch.bfloat16) for m, n, k, bias in
             [(64, 4608, 3584, False), (257, 1008, 3584, True), (1024, 3584, 18944, False), (300, 512, 272, False)]]
    cases += [("mxfp4", 130, 2880, 2880, True, torch.bfloat16)]
    fails = check_product("cuda", cases)
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_dispatch_routes_by_rows(fmt):
    """Below w4a8_min_m rows compute fp8 keeps the 16-bit kernels (the same bits as compute bf16); from it the W4A8
    product; a weight with N % 16 != 0 is emulated (`_scaled_mm` cannot take it)."""
    _fp8_gpu()
    from qerl.kernels import quantized_linear
    from qerl.kernels.route import current_policy, kernel_policy

    lo = current_policy().w4a8_min_m
    for n in (512, 520):
        t = _weights(fmt, n, 1024, "cuda", 3)
        f = AS_FP8[fmt](**t)
        for m in (lo - 1, lo, 700):
            x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
            with kernel_policy(compute="fp8"):
                y = quantized_linear(fmt, x, t)
            y16 = quantized_linear(fmt, x, t)
            if m < lo:
                assert torch.equal(y, y16), (n, m, float((y.float() - y16.float()).abs().max()))
                continue
            assert not torch.equal(y, y16), (n, m)  # FP8 activations: not the 16-bit product
            q, s = quantize_rows_fp8(x)
            ref = _reference(q, s, f)
            # N % 16 == 0: the tensor cores; else the fp32 emulation (cuBLAS fp32 products, maybe TF32's 10 bits)
            tol = scaled_mm_tolerance(q, s, f, ref, y.dtype) if n % 16 == 0 else 2 ** -8 * ref.abs() + 2 ** -10 * (
                (q.double().abs() * s.double()) @ (f["weight"].double().abs() * f["weight_scale"].double()).t())
            err = (y.double() - ref).abs()
            assert (err <= tol).all(), (n, m, float((err / tol)[tol > 0].max()))


@pytest.mark.gpu
def test_gpu_captured_product_survives_a_rebuilt_view_of_its_scales():
    """A CUDA graph that captured `w4a8_linear` keeps giving the right product after the scale tensor it saw is
    replaced by a new view of the same memory and freed memory is reused (the engine rebuilds its fused sibling
    views on every refresh; shifts cached on the old view object were freed with it and read as garbage)."""
    _fp8_gpu()
    from qerl.kernels.fp8_matmul import w4a8_linear

    t = _weights("nvfp4", 1536, 1024, "cuda", 5)
    f = AS_FP8["nvfp4"](**t)

    def view():
        s = t["weight_scale"]
        return {**t, "weight_scale": s.as_strided(s.shape, s.stride())}

    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    v1 = view()
    w4a8_linear("nvfp4", x, v1)  # eager first, as the engine's warm-up is
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = w4a8_linear("nvfp4", x, v1)
    torch.cuda.current_stream().wait_stream(stream)
    del v1
    w4a8_linear("nvfp4", x, view())  # the next refresh's view, eagerly
    junk = [torch.full((1536, 1), float("nan"), device="cuda") for _ in range(64)]  # reuse what was freed
    x.copy_(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    q, s = quantize_rows_fp8(x)
    ref = _reference(q, s, f)
    err = (y.double() - ref).abs()
    tol = scaled_mm_tolerance(q, s, f, ref, y.dtype)
    assert (err <= tol).all(), float((err / tol)[tol > 0].max())
    del junk
