"""Quantization error per weight format: relative Frobenius error ||W - deq(q(W))|| / ||W|| and storage
bits per weight (codes + scales + global scale) on 4096x4096 weights of three distributions; with
--model, per layer type of a real model instead (mean over layers, the global scales `quantize_model`
uses): the error on all weights, on the 0.1% largest-magnitude ones, and the share of nonzero weights
rounded to 0.

    python benchmarks/quant_error.py                                               # CPU, under a minute
    python benchmarks/quant_error.py --model smollm2-135m-instruct --formats nvfp4,nf4   # CPU, ~1 minute
"""

import argparse
import time

import torch

from qerl.formats import FORMATS

N = K = 4096


def weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """fp32 [N, K] test matrices: Gaussian, Student-t (df=3, heavy tails), Gaussian with 0.1% of the
    entries multiplied by 50 (the outlier features of real LLM layers)."""
    gauss = torch.randn(N, K, generator=gen)
    chi2 = torch.randn(3, N, K, generator=gen).pow(2).sum(0)  # chi-squared, 3 degrees of freedom
    student = torch.randn(N, K, generator=gen) / (chi2 / 3).sqrt()
    outliers = torch.randn(N, K, generator=gen)
    mask = torch.rand(N, K, generator=gen) < 1e-3
    outliers[mask] *= 50.0
    return {"gaussian": gauss, "student-t df=3": student, "gauss+0.1% 50x": outliers}


def bits_per_weight(tensors: dict[str, torch.Tensor], numel: int) -> float:
    return sum(t.numel() * t.element_size() * 8 for t in tensors.values()) / numel


def model_errors(name: str, formats: list[str]) -> None:
    from qerl.models import load_causal_lm
    from qerl.models.surgery import shared_global_scales
    from qerl.models.targets import find_targets
    from qerl.nn import DEFAULT_TARGETS

    model, _ = load_causal_lm(name)
    linears = find_targets(model, DEFAULT_TARGETS)
    print(f"{'layer':<11}{'format':<8}{'rel err':>9}{'top 0.1%':>10}{'to zero':>9}   ({name}, mean over layers)")
    for fmt_name in formats:
        fmt, scales = FORMATS[fmt_name], shared_global_scales(linears, fmt_name)
        per_leaf: dict[str, list[tuple[float, float, float]]] = {}
        for path, lin in linears.items():
            w = lin.weight.detach().float()
            err = fmt.dequantize(**fmt.quantize(lin.weight.detach(), scales.get(path)), dtype=torch.float32) - w
            top = w.abs().flatten().topk(max(1, w.numel() // 1000)).indices
            zeroed = ((err == -w) & (w != 0)).float().mean()
            per_leaf.setdefault(path.rsplit(".", 1)[-1], []).append(
                (float(err.norm() / w.norm()), float(err.flatten()[top].norm() / w.flatten()[top].norm()),
                 float(zeroed)))
        for leaf, rows in per_leaf.items():
            mean = [sum(r[i] for r in rows) / len(rows) for i in range(3)]
            print(f"{leaf:<11}{fmt_name:<8}{mean[0]:>9.4f}{mean[1]:>10.4f}{mean[2]:>9.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="embedded name, HF directory or GGUF: per-layer errors of its linears")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma list (with --model)")
    args = ap.parse_args()
    if args.model:
        model_errors(args.model, args.formats.split(","))
        return
    start = time.perf_counter()
    mats = weights(torch.Generator().manual_seed(0))
    names = list(mats)
    print(f"{'format':<8}{'bits/w':>8}" + "".join(f"{n:>18}" for n in names))
    for fmt_name, fmt in FORMATS.items():
        row, bits = [], None
        for w in mats.values():
            q = fmt.quantize(w)
            bits = bits_per_weight(q, w.numel())
            err = (fmt.dequantize(**q) - w).norm() / w.norm()
            row.append(f"{err.item():>18.5f}")
        print(f"{fmt_name:<8}{bits:>8.3f}" + "".join(row))
    print(f"({N}x{K} fp32 weights, relative Frobenius error; {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
