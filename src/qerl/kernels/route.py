"""Which backend computes a matmul against a stored weight: one rule, `route`, over (format, M, N, K, device).

Imports no Triton (CPU users may not have it). The thresholds live in `KernelPolicy`, a frozen dataclass read
from a context variable: `with kernel_policy(fused_max_m=32): ...` changes them for a scope (a benchmark, a
test) and nowhere else. Their default values are data, one JSON file per device family in kernels/tuning/
(`TUNING_FILES`): default.json holds what every device uses, sm90.json what only the sm_90 rules read; the same
files hold the kernels' tile tables (`tile_config`). The rules and the measurements that set them (H200;
docs/benchmarks.md, section "What runs where", and the benchmark named at each field):

  NVFP4 forward x @ W^T (bf16 x, K % 128 == 0, global scale > 128, sm_80+: the Gluon swap-AB kernels)
    rows 1..swap_max_m          Gluon, mma.sync form (`gluon_mma`); on sm_90 the wgmma form instead for
                                wgmma_min_m..swap_max_m rows, and from wgmma_small_m rows for weights of
                                >= wgmma_small_m_min_weight elements (`gluon_wgmma`; `gluon_wgmma_xp` when x is
                                rewritten once in operand order: weights of >= big_weight elements, and above
                                swap_max_m rows weights of >= permute_x_min_weight elements);
    sm_90, up to wgmma_max_m    the wgmma form, wide_m_tile-row tiles (128 and up to wgmma_max_m_big rows for
                                weights of >= big_weight elements);
    sm_90, ws_min_m..ws_max_m   for weights of >= ws_min_n rows and >= ws_min_weight elements: the
                                warp-specialized wgmma kernel (`gluon_wgmma_ws`; set on an H100), ahead of
                                the rules above;
  otherwise (and for fp16 x, other K, small global scales, older GPUs, MXFP4, and the input gradient dY @ W):
    rows 1..gemv_max_m          the CUDA-core kernel (`triton_gemv`; NVFP4 forward only);
    rows <= fused_max_m         the tl.dot kernel decoding W in registers (`triton_dot`), also up to
                                fused_max_m_big rows for weights of >= big_weight elements;
    NVFP4 dY @ W on sm_90       (bf16 dY, N % 8 == 0, K % 32 == 0, global scale > 128) the Gluon input-gradient
                                kernel (`gluon_grad_input`) at grad_input_min_m..grad_input_max_m rows for weights
                                of >= grad_input_min_weight elements (..grad_input_max_m_big from
                                grad_input_big_weight), and wherever the next rule would apply when
                                grad_input_no_temporary is set;
    above                       one Triton pass dequantizes W into a temporary, then cuBLAS (`triton_dequantize`).
  bf16 weights: the Gluon bf16 kernel (`gluon_bf16`) for 1..bf16_swap_max_m rows on sm_80+, else F.linear.
  No CUDA bf16/fp16 input, or Triton off: the plain-torch reference (`torch_dequantize`; `torch_linear` for
  bf16 weights); it is also what the kernels are tested against.

A LoRA term h @ b^T rides in the Gluon kernels' epilogue up to lora_in_kernel_max_r (`lora_in_kernel`), else
one addmm follows. A backend that fails to import or compile on this machine is reported once (a warning) and
excluded from then on (`unavailable` / `mark_unavailable`); `KernelPolicy.disabled` excludes backends on purpose.
"""

import dataclasses
import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import resources

import torch

from ..choices import COMPUTE as COMPUTE_CHOICES

# Backend names, as `route` returns them
TORCH_DEQUANTIZE = "torch_dequantize"  # plain torch: dequantize W into a temporary, F.linear (reference, CPU)
TORCH_LINEAR = "torch_linear"  # F.linear on a 16-bit weight (cuBLAS on CUDA)
TRITON_DEQUANTIZE = "triton_dequantize"  # `triton.fp4.*_dequantize_triton` into a temporary, then cuBLAS
TRITON_DOT = "triton_dot"  # `triton.fp4.*_linear_triton` / `*_grad_input_triton` (tl.dot, W decoded in registers)
TRITON_GEMV = "triton_gemv"  # `triton.fp4.nvfp4_linear_gemv` (CUDA cores)
GLUON_MMA = "gluon_mma"  # `gluon.nvfp4`, mma.sync
GLUON_WGMMA = "gluon_wgmma"  # `gluon.nvfp4` launching `gluon.nvfp4_wgmma`, x staged through registers
GLUON_WGMMA_XP = "gluon_wgmma_xp"  # the same, x rewritten once in operand order (`permute_x_kernel`)
GLUON_WGMMA_WS = "gluon_wgmma_ws"  # `gluon.nvfp4_wgmma_ws`: TMA producer warp, two decoding wgmma warpgroups
GLUON_BF16 = "gluon_bf16"  # `gluon.bf16`
GLUON_GRAD_INPUT = "gluon_grad_input"  # `gluon.nvfp4_grad_input`: dY @ W with W decoded in registers (sm_90)
GLUON_NVFP4 = (GLUON_MMA, GLUON_WGMMA, GLUON_WGMMA_XP, GLUON_WGMMA_WS)
BACKENDS = (TORCH_DEQUANTIZE, TORCH_LINEAR, TRITON_DEQUANTIZE, TRITON_DOT, TRITON_GEMV, *GLUON_NVFP4, GLUON_BF16,
            GLUON_GRAD_INPUT)


# Tuning data, in this order; a key set by two files is an error (each family's file holds only its own rules)
TUNING_FILES = ("default.json", "sm90.json")


def load_tuning(files: tuple[str, ...] = TUNING_FILES) -> dict:
    """{"policy": {KernelPolicy field: default}, "tiles": {backend: [row, ...]}} merged from kernels/tuning/<files>
    (package data). A tile table's rows: see `tile_config`."""
    merged: dict = {"policy": {}, "tiles": {}}
    for name in files:
        data = json.loads((resources.files(__package__) / "tuning" / name).read_text())
        for section, values in merged.items():
            again = sorted(values.keys() & data.get(section, {}).keys())
            if again:
                raise ValueError(f"kernels/tuning/{name}: {section} {again} already set by an earlier file")
            values.update(data.get(section, {}))
    return merged


TUNING = load_tuning()
_TUNED = TUNING["policy"]


@dataclass(frozen=True)
class KernelPolicy:
    """The routing thresholds (rows M, weight sizes N * K in elements) and switches; see the module docstring.
    The thresholds' defaults come from kernels/tuning/*.json (`TUNING`); the comments name what measured them."""

    triton: bool | None = None  # None: when Triton is importable and QERL_DISABLE_TRITON is not "1"
    # NVFP4 forward, Gluon swap-AB kernels (`qerl bench kernels --swap`, src/qerl/bench/kernels.py)
    swap_max_m: int = _TUNED["swap_max_m"]
    wgmma_min_m: int = _TUNED["wgmma_min_m"]
    wgmma_small_m: int = _TUNED["wgmma_small_m"]
    wgmma_small_m_min_weight: int = _TUNED["wgmma_small_m_min_weight"]  # 100 * 2^20
    # rows above swap_max_m (`qerl bench kernels`, routed vs deq+cuBLAS at M = 128/256)
    wgmma_max_m: int = _TUNED["wgmma_max_m"]
    wgmma_max_m_big: int = _TUNED["wgmma_max_m_big"]
    # the warp-specialized wgmma kernel: ws_min_m..ws_max_m rows, weights with >= ws_min_n rows and
    # >= ws_min_weight (2^27) elements (H100: docs/benchmarks.md section "Warp-specialized NVFP4 kernel",
    # measured with `wgmma_ws_ab.py` in docs/benchmarks.md's script list)
    ws_min_m: int = _TUNED["ws_min_m"]
    ws_max_m: int = _TUNED["ws_max_m"]
    ws_min_n: int = _TUNED["ws_min_n"]
    ws_min_weight: int = _TUNED["ws_min_weight"]
    # NVFP4 input gradient dY @ W on sm_90: the Gluon kernel at grad_input_min_m..grad_input_max_m rows for
    # weights of >= grad_input_min_weight (2^26) elements, up to grad_input_max_m_big rows from
    # grad_input_big_weight (192 * 2^20) (H100: docs/benchmarks.md section "NVFP4 input gradient", measured with
    # `grad_input_ab.py` in docs/benchmarks.md's script list); grad_input_no_temporary: also at every other M that would
    # dequantize W into a temporary (slower from ~512 rows, but never holds an N x K 16-bit copy of W; the
    # training config's optim.grad_input_no_temporary)
    grad_input_min_m: int = _TUNED["grad_input_min_m"]
    grad_input_max_m: int = _TUNED["grad_input_max_m"]
    grad_input_max_m_big: int = _TUNED["grad_input_max_m_big"]
    grad_input_min_weight: int = _TUNED["grad_input_min_weight"]
    grad_input_big_weight: int = _TUNED["grad_input_big_weight"]
    grad_input_no_temporary: bool = False
    # "big" weights (32 * 2^20 elements): above it the wgmma form takes x pre-permuted and more rows, and the
    # tl.dot kernel more rows
    big_weight: int = _TUNED["big_weight"]
    permute_x: bool | None = None  # wgmma form: force x staged (False) or pre-permuted (True); None: the rule
    # the wgmma form above swap_max_m rows on weights under big_weight (a 1.5B model's every linear; H200:
    # docs/benchmarks.md "Small weights at rollout rows", `small_weight_tiles.py` in docs/benchmarks.md's script list):
    # activation rows per tile, the weight size (8 * 2^20) from which x is pre-permuted (staged below it), and,
    # above 32 rows, the fewest K tiles one split may take (each split adds an M x N fp32 partial; 128 / 0 / 1 =
    # the earlier rule)
    wide_m_tile: int = _TUNED["wide_m_tile"]
    permute_x_min_weight: int = _TUNED["permute_x_min_weight"]
    wide_m_min_k_tiles: int = _TUNED["wide_m_min_k_tiles"]
    # Triton kernels (`qerl bench kernels` and `--decode`)
    gemv_max_m: int = _TUNED["gemv_max_m"]
    fused_max_m: int = _TUNED["fused_max_m"]
    fused_max_m_big: int = _TUNED["fused_max_m_big"]
    # bf16 weights (`qerl bench rollout --variants bf16+lora`, docs/benchmarks.md "Rollout engine")
    bf16_swap_max_m: int = _TUNED["bf16_swap_max_m"]
    # widest LoRA rank sum the Gluon kernels' epilogue takes (its B tile [BN, R] lives in registers)
    lora_in_kernel_max_r: int = _TUNED["lora_in_kernel_max_r"]
    disabled: frozenset[str] = frozenset()  # backends `route` must not return (tests, benchmarks, debugging)
    # model.compute: "fp8" multiplies NVFP4 / MXFP4 weights decoded to e4m3 with activations rounded to e4m3 per
    # token (W4A8; `qerl.kernels.dispatch`); "bf16" keeps the 16-bit products
    compute: str = "bf16"
    # model.compute fp8 on FP8 tensor cores (`qerl.kernels.fp8_matmul.w4a8_linear`: the weight decoded to e4m3, then
    # torch._scaled_mm) from w4a8_min_m rows; below, the bf16 kernels above (H200: `qerl bench kernels --compute
    # fp8`, docs/benchmarks.md "W4A8")
    w4a8_min_m: int = _TUNED["w4a8_min_m"]
    # model.dense_weights on a GPU: a product of NVFP4 / MXFP4 weights with a kept 16-bit copy reads the copy
    # (cuBLAS bf16) from dense_min_m rows and the 4-bit weight through its kernels below, where they win
    # (H200: `qerl bench rollout --variants nvfp4+lora,nvfp4+lora+dense`, docs/benchmarks.md "Rollout engine")
    dense_min_m: int = _TUNED["dense_min_m"]


def reads_dense_copy(fmt: str, m: int, on_gpu_kernels: bool, policy: KernelPolicy | None = None) -> bool:
    """Whether a product of m rows against a weight of format `fmt` that has a kept 16-bit copy reads that copy:
    always without the 4-bit GPU kernels (the CPU, NF4, Triton off), else from `dense_min_m` rows on."""
    if not on_gpu_kernels or fmt not in ("nvfp4", "mxfp4"):
        return True
    return m >= (policy or _POLICY.get()).dense_min_m


_POLICY: ContextVar[KernelPolicy] = ContextVar("qerl_kernel_policy", default=KernelPolicy())


def current_policy() -> KernelPolicy:
    return _POLICY.get()


@contextmanager
def kernel_policy(policy: KernelPolicy | None = None, **overrides) -> Iterator[KernelPolicy]:
    """Inside, kernels route by `policy` (default: the current one) with `overrides` applied, e.g.
    `with kernel_policy(triton=False):` for the plain-torch reference, `kernel_policy(disabled={"gluon_mma"})`."""
    p = policy or _POLICY.get()
    if "disabled" in overrides:
        overrides["disabled"] = frozenset(overrides["disabled"])
    token = _POLICY.set(dataclasses.replace(p, **overrides) if overrides else p)  # frozen: no copy needed
    try:
        yield _POLICY.get()
    finally:
        _POLICY.reset(token)


TILE_CONDITIONS = ("max_m", "min_weight", "x_permuted", "n_above_k_times", "k_above")  # see `tile_config`


def _compile_tiles(tiles: dict) -> dict:
    """TUNING["tiles"] as {backend: [(max_m, min_weight, x_permuted, n_above_k_times, k_above, tile,
    programs_per_sm, reads_policy)]}, an absent condition None (what `tile_config` loops over)."""
    out = {}
    for backend, rows in tiles.items():
        out[backend] = []
        for row in rows:
            unknown = set(row) - {*TILE_CONDITIONS, "tile", "programs_per_sm"}
            if unknown:
                raise ValueError(f"kernels/tuning: {backend} row {row}: unknown keys {sorted(unknown)}")
            conds = tuple(row.get(c) for c in TILE_CONDITIONS)
            values = (*conds, *row["tile"].values())
            out[backend].append((*conds, row["tile"], row.get("programs_per_sm"),
                                 any(isinstance(v, str) for v in values)))
    return out


_TILES = _compile_tiles(TUNING["tiles"])


def tile_config(backend: str, m: int, n: int = 0, k: int = 0, *, x_permuted: bool | None = None,
                policy: KernelPolicy | None = None) -> dict:
    """The launch tile of `backend` for an [m, k] x [n, k]^T product: the first row of its table in `TUNING`
    ("tiles") that matches, as {tile parameter: value} plus "programs_per_sm" where the row gives one. A row
    matches when every condition it states holds (`TILE_CONDITIONS`): max_m (m <= max_m; null: any m),
    min_weight (n * k >=), x_permuted (equal to the argument), n_above_k_times (n > value * k), k_above (k >).
    A value given as a string is the `KernelPolicy` field of that name, read from `policy` (default: the current
    one)."""
    p = policy
    for max_m, min_weight, xp, n_above_k_times, k_above, tile, programs, reads_policy in _TILES[backend]:
        if reads_policy:
            p = p or _POLICY.get()
            max_m, min_weight, n_above_k_times, k_above = [getattr(p, v) if isinstance(v, str) else v for v in
                                                           (max_m, min_weight, n_above_k_times, k_above)]
        if ((max_m is None or m <= max_m) and (min_weight is None or n * k >= min_weight)
                and (xp is None or x_permuted == xp) and (n_above_k_times is None or n > n_above_k_times * k)
                and (k_above is None or k > k_above)):
            out = {name: getattr(p, v) if isinstance(v, str) else v for name, v in tile.items()} \
                if reads_policy else dict(tile)
            if programs is not None:
                out["programs_per_sm"] = programs
            return out
    raise LookupError(f"no row of the {backend!r} tile table takes m={m}, n={n}, k={k}, x_permuted={x_permuted}")


def parse_policy_overrides(text: str) -> dict:
    """"FIELD=VALUE,..." -> {field: value} for `kernel_policy(**overrides)` (a benchmark's --policy), each value
    read as its `KernelPolicy` field's type: int (e.g. wgmma_max_m=64), bool or none (permute_x=false, triton=none),
    a "+"-separated backend list for disabled, bf16 or fp8 for compute (model.compute, e.g. `qerl bench rollout
    --policy compute=fp8`). ValueError naming the field for an unknown one or a bad value."""
    fields = {f.name: f for f in dataclasses.fields(KernelPolicy)}
    out = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not sep or name not in fields:
            raise ValueError(f"kernel policy {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        kind = str(fields[name].type)
        if name == "disabled":
            out[name] = frozenset(b for b in value.split("+") if b)
            unknown = sorted(out[name] - set(BACKENDS))
            if unknown:
                raise ValueError(f"kernel policy disabled: unknown backends {unknown}; known: {', '.join(BACKENDS)}")
        elif "bool" in kind:
            if value not in ("true", "false") and not ("None" in kind and value == "none"):
                raise ValueError(f"kernel policy {name}: expected true or false{' or none' * ('None' in kind)}, "
                                 f"got {value!r}")
            out[name] = None if value == "none" else value == "true"
        elif name == "compute":
            if value not in COMPUTE_CHOICES:
                raise ValueError(f"kernel policy compute: expected one of {', '.join(COMPUTE_CHOICES)}, got {value!r}")
            out[name] = value
        else:
            try:
                out[name] = int(value)
            except ValueError:
                raise ValueError(f"kernel policy {name}: expected an integer, got {value!r}") from None
    return out


def policy_overrides_json(overrides: dict) -> dict:
    """`parse_policy_overrides`' result as JSON values (a disabled set as a sorted list), for a benchmark's record."""
    return {k: sorted(v) if isinstance(v, frozenset) else v for k, v in overrides.items()}


_UNAVAILABLE: set[str] = set()  # backends that failed to import or compile in this process (see mark_unavailable)


def mark_unavailable(*backends: str) -> None:
    """Exclude backends from routing for the rest of the process (they failed to import or compile here)."""
    _UNAVAILABLE.update(backends)


def unavailable() -> frozenset[str]:
    return frozenset(_UNAVAILABLE)


def wgmma_rows(p: KernelPolicy, m: int, n: int, k: int) -> bool:
    """Rows for which the sm_90 wgmma form beats the mma.sync form (<= swap_max_m) or dequantize + cuBLAS (above)."""
    if p.wgmma_small_m <= m < p.wgmma_min_m:
        return n * k >= p.wgmma_small_m_min_weight
    if m <= p.swap_max_m:
        return p.wgmma_min_m <= m
    return m <= (p.wgmma_max_m_big if n * k >= p.big_weight else p.wgmma_max_m)


def ws_rows(p: KernelPolicy, m: int, n: int, k: int) -> bool:
    """Shapes for which the warp-specialized wgmma kernel beats both the single-warpgroup form and dequantize +
    cuBLAS (H100: the 7B/32B/72B gate_up and the 72B down weights at 256-1024 rows; it loses on q/k/v, o and the
    7B/32B down weights, and from 2048 rows on the 7B gate_up)."""
    return p.ws_min_m <= m <= p.ws_max_m and n >= p.ws_min_n and n * k >= p.ws_min_weight


def permute_x_rule(p: KernelPolicy, m: int, n: int, k: int) -> bool:
    """wgmma form: rewrite x in operand order first (one extra small launch) rather than stage it every step:
    for big weights, and above swap_max_m rows for weights of >= permute_x_min_weight elements (below that
    the extra launch costs more than staging saves: a 1.5B model's q/k/v and o)."""
    return n * k >= p.big_weight or (m > p.swap_max_m and n * k >= p.permute_x_min_weight)


def permute_x(p: KernelPolicy, m: int, n: int, k: int) -> bool:
    """`permute_x_rule`, unless the policy forces it (p.permute_x)."""
    return permute_x_rule(p, m, n, k) if p.permute_x is None else p.permute_x


def fused_rows(p: KernelPolicy, m: int, n: int, k: int) -> bool:
    """The tl.dot kernel (True) or dequantize + cuBLAS (False), either direction."""
    return m <= p.fused_max_m or (m <= p.fused_max_m_big and n * k >= p.big_weight)


def grad_input_rows(p: KernelPolicy, m: int, n: int, k: int) -> bool:
    """Shapes for which the NVFP4 input-gradient kernel beats the tl.dot kernel and dequantize + cuBLAS (H100:
    65-256 rows on weights of >= 2^26 elements, to 512 rows from 192M: the 32B/72B MLP weights, not the 7B gate_up,
    which ties at 512 rows on the H100 and loses 10% on the H200; at 64 rows tl.dot wins on the 72B gate_up, the 7B
    q/k/v and o lose from 128 rows, every shape from ~1024)."""
    if m < p.grad_input_min_m or n * k < p.grad_input_min_weight:
        return False
    return m <= (p.grad_input_max_m_big if n * k >= p.grad_input_big_weight else p.grad_input_max_m)


def route(fmt: str, m: int, n: int, k: int, capability: tuple[int, int] | None, *, op: str = "forward",
          dtype: torch.dtype = torch.bfloat16, lora_r: int = 0, step_fits: bool = True,
          unavailable: frozenset[str] = frozenset(), policy: KernelPolicy | None = None) -> str:
    """The backend for y[M, N] = x[M, K] @ W[N, K]^T (op "forward") or dY[M, N] @ W (op "grad_input"), W stored
    in `fmt`. capability: the CUDA device's (major, minor), None when the input is not on a CUDA device or
    Triton is off (`kernel_capability`); dtype: the activation's; lora_r: the rank sum of a LoRA term added to
    the forward (0: none); step_fits: the NVFP4 global scale allows the bf16 decode step (`step_fits_bf16`);
    unavailable: backends that cannot run here. Pure: the same arguments always give the same name."""
    p = policy or _POLICY.get()
    off = p.disabled | unavailable
    kernels = capability is not None and dtype in (torch.bfloat16, torch.float16)
    if fmt == "bf16":
        if (kernels and dtype == torch.bfloat16 and op == "forward" and 1 <= m <= p.bf16_swap_max_m
                and lora_r <= p.lora_in_kernel_max_r and capability >= (8, 0) and k % 8 == 0 and n * k < 2**31
                and GLUON_BF16 not in off):
            return GLUON_BF16
        return TORCH_LINEAR
    if fmt not in ("nvfp4", "mxfp4") or not kernels:
        return TORCH_DEQUANTIZE
    if fmt == "nvfp4" and op == "forward":
        if dtype == torch.bfloat16 and k % 128 == 0 and step_fits and capability >= (8, 0) and m >= 1:
            if capability == (9, 0) and ws_rows(p, m, n, k) and GLUON_WGMMA_WS not in off:
                return GLUON_WGMMA_WS
            if capability == (9, 0) and wgmma_rows(p, m, n, k):
                wg = GLUON_WGMMA_XP if permute_x(p, m, n, k) else GLUON_WGMMA
                if wg not in off:
                    return wg
            if m <= p.swap_max_m and GLUON_MMA not in off:
                return GLUON_MMA
        if 1 <= m <= p.gemv_max_m and TRITON_GEMV not in off:
            return TRITON_GEMV
    fused = fused_rows(p, m, n, k) and TRITON_DOT not in off
    if (fmt == "nvfp4" and op == "grad_input" and dtype == torch.bfloat16 and capability == (9, 0) and step_fits
            and n % 8 == 0 and k % 32 == 0 and GLUON_GRAD_INPUT not in off
            and (grad_input_rows(p, m, n, k) or (p.grad_input_no_temporary and not fused))):
        return GLUON_GRAD_INPUT
    return TRITON_DOT if fused else TRITON_DEQUANTIZE


def lora_in_kernel(backend: str, lora_r: int, policy: KernelPolicy | None = None) -> bool:
    """Whether `backend` adds a LoRA term of rank sum lora_r in its own launch (else one addmm follows)."""
    p = policy or _POLICY.get()
    return backend in (*GLUON_NVFP4, GLUON_BF16) and 0 < lora_r <= p.lora_in_kernel_max_r


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_enabled(policy: KernelPolicy | None = None) -> bool:
    """Triton kernels on: the policy says so, or (policy.triton None) Triton is importable and the
    QERL_DISABLE_TRITON environment variable is not "1" (a user switch for debugging)."""
    p = policy or _POLICY.get()
    if p.triton is not None:
        return p.triton and triton_available()
    return os.environ.get("QERL_DISABLE_TRITON", "0") != "1" and triton_available()


def use_triton(x: torch.Tensor) -> bool:
    """True when x should go through the Triton kernels (a CUDA bf16/fp16 tensor, Triton on)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and triton_enabled()


def kernel_capability(x: torch.Tensor) -> tuple[int, int] | None:
    """`route`'s capability argument for an input x: its CUDA device's, or None when no kernel may take it."""
    return torch.cuda.get_device_capability(x.device) if use_triton(x) else None


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device, cpu_stand_in: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached); `cpu_stand_in` for the Triton interpreter on the
    CPU, which has none (a small number that still exercises the kernels' splits)."""
    if device.type != "cuda":
        return cpu_stand_in
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def rows(x: torch.Tensor) -> int:
    """Number of rows M of x viewed as [M, features]."""
    return x.numel() // max(1, x.shape[-1])
