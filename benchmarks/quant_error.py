"""Quantization error per weight format: relative Frobenius error ||W - deq(q(W))|| / ||W|| and storage
bits per weight (codes + scales + global scale) on 4096x4096 weights of three distributions.

    python benchmarks/quant_error.py          # CPU, well under a minute
"""

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


def main() -> None:
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
