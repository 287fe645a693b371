"""Can NVFP4 weights feed FP8 (e4m3) tensor cores without a second rounding? Measured on a real model's linears.

An NVFP4 value is an E2M1 code (1 mantissa bit) times an E4M3 block scale (3 mantissa bits) over an fp32 global
scale: up to 5 significant bits, while e4m3 holds 4. Decoding a weight to e4m3 with one fp32 scale per output
channel (what a W4A8 kernel would multiply) therefore rounds some values a second time. The alternative: NVFP4
with every block scale a power of two (still a valid NVFP4 tensor; each value then has at most 2 significant
bits and converts to e4m3 exactly while the row's range fits e4m3's), at the price of coarser block scales.

    python experiments/w4a8_weights.py --model smollm2-135m-instruct
    python experiments/w4a8_weights.py --model qwen2.5-coder-1.5b-instruct --out w4a8.json

Per model, over every target linear (sums over layers, so large layers weigh more), relative squared errors
||A - B||^2 / ||W||^2 against the 16-bit weight W:
  nvfp4            the NVFP4 (round-to-nearest) weight Q
  nvfp4 -> e4m3    Q converted to e4m3 with a per-channel scale amax/448: its total error, its extra error
                   ||E - Q||^2 / ||W||^2 and the share of elements E changed
  nvfp4 decoded    what a W4A8 kernel would multiply (`qerl.formats.fp8.nvfp4_as_fp8`): each code times its
                   E4M3 block scale rounded to e4m3 (after a per-row power-of-two shift within 448), the global
                   scale left to the epilogue
  pow2 nvfp4       NVFP4 with power-of-two block scales P (round up, so no code saturates)
  pow2 -> e4m3     P converted with a power-of-two per-channel scale (extra error and changed share: 0 unless a
                   row's range exceeds e4m3's, 2^-9 .. 448)
"""

import argparse
import json
import sys
import time

import torch

from qerl.formats.fp4 import E2M1_MAX, decode_e2m1, round_to_e2m1
from qerl.formats.fp8 import dequantize_fp8, nvfp4_as_fp8, quantize_fp8
from qerl.formats.nvfp4 import BLOCK, dequantize_nvfp4, quantize_nvfp4

E4M3_MIN_EXP, E4M3_MAX_POW2 = -9, 256.0  # smallest e4m3 subnormal 2^-9; largest power of two below 448


def nvfp4_pow2(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> the NVFP4 weight whose block scales are powers of two (rounded up from amax_b / 6, so codes stay
    within E2M1's ±6) under a power-of-two global scale that keeps every block scale <= 256; dequantized, fp32."""
    w = w.float()
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    amax = w.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    gs = torch.exp2(torch.floor(torch.log2(E4M3_MAX_POW2 * E2M1_MAX / amax)))
    need = gs * blocks.abs().amax(-1) / E2M1_MAX
    exp = torch.ceil(torch.log2(need.clamp(min=2.0 ** E4M3_MIN_EXP))).clamp(E4M3_MIN_EXP, 8)
    step = torch.exp2(exp) / gs
    codes = round_to_e2m1((blocks / step.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return (decode_e2m1(codes) * step.unsqueeze(-1)).reshape(n, k)


def to_e4m3(q: torch.Tensor, power_of_two: bool = False) -> torch.Tensor:
    """Q [N, K] fp32 -> its e4m3 form with one fp32 scale per row, dequantized, fp32: the scale amax/448
    (`qerl.formats.fp8`), or with power_of_two the smallest power of two that maps the row's amax within 448 (a
    power-of-two value then converts exactly)."""
    if not power_of_two:
        t = quantize_fp8(q)
        return t["weight"].float() * t["weight_scale"]
    amax = q.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return (q / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def measure(weights: dict[str, torch.Tensor]) -> dict:
    """Summed squared errors over the layers, relative to the summed ||W||^2 (module docstring)."""
    sums = dict.fromkeys(("w", "nvfp4", "nvfp4_e4m3", "nvfp4_cast", "nvfp4_decoded", "nvfp4_decoded_cast", "pow2",
                          "pow2_e4m3", "pow2_cast"), 0.0)
    changed = {"nvfp4": 0, "nvfp4_decoded": 0, "pow2": 0}
    elements = 0
    for w in weights.values():
        w = w.float()
        t = quantize_nvfp4(w)
        q, d = dequantize_nvfp4(**t), dequantize_fp8(**nvfp4_as_fp8(**t))
        p = nvfp4_pow2(w)
        eq, ep = to_e4m3(q), to_e4m3(p, power_of_two=True)
        sq = lambda a, b: float((a - b).double().square().sum())  # noqa: E731
        sums["w"] += float(w.double().square().sum())
        sums["nvfp4"] += sq(q, w)
        sums["nvfp4_e4m3"] += sq(eq, w)
        sums["nvfp4_cast"] += sq(eq, q)
        sums["nvfp4_decoded"] += sq(d, w)
        sums["nvfp4_decoded_cast"] += sq(d, q)
        sums["pow2"] += sq(p, w)
        sums["pow2_e4m3"] += sq(ep, w)
        sums["pow2_cast"] += sq(ep, p)
        changed["nvfp4"] += int((eq != q).sum())
        changed["nvfp4_decoded"] += int(((d - q).abs() > 2 ** -20 * q.abs()).sum())  # beyond fp32 op-order ulps
        changed["pow2"] += int((ep != p).sum())
        elements += w.numel()
    rel = {k: v / sums["w"] for k, v in sums.items() if k != "w"}
    return {**rel, **{f"changed_{k}": v / elements for k, v in changed.items()}, "layers": len(weights),
            "elements": elements}


def model_weights(name: str) -> dict[str, torch.Tensor]:
    """The target linears' weights of a model (qerl's default targets), as stored (bf16 for the embedded ones)."""
    from qerl.models.pretrained import load_causal_lm
    from qerl.nn import DEFAULT_TARGETS

    model, _ = load_causal_lm(name, dtype="bf16", device="cpu")
    return {n: m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in DEFAULT_TARGETS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    r = measure(model_weights(args.model))
    print(f"{args.model}: {r['layers']} linears, {r['elements'] / 1e6:.0f} M weights, "
          f"{time.perf_counter() - t0:.0f} s; relative squared error vs the 16-bit weights")
    print("| weight | error | extra error of the e4m3 conversion | elements the conversion changed |")
    print("|---|---:|---:|---:|")
    print(f"| NVFP4 (round-to-nearest) | {r['nvfp4']:.3e} | | |")
    print(f"| NVFP4 -> e4m3, channel scale amax/448 | {r['nvfp4_e4m3']:.3e} | {r['nvfp4_cast']:.3e} | "
          f"{r['changed_nvfp4']:.2%} |")
    print(f"| NVFP4 decoded to e4m3 (code x block scale; global scale in the epilogue) | {r['nvfp4_decoded']:.3e} | "
          f"{r['nvfp4_decoded_cast']:.3e} | {r['changed_nvfp4_decoded']:.2%} |")
    print(f"| NVFP4, power-of-two block scales | {r['pow2']:.3e} | | |")
    print(f"| that -> e4m3, power-of-two channel scale | {r['pow2_e4m3']:.3e} | {r['pow2_cast']:.3e} | "
          f"{r['changed_pow2']:.2%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, **r}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
