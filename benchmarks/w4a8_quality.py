"""How far NVFP4 weights with FP8 activations (W4A8) move a model from the NVFP4 policy qerl runs today (W4A16):
KL per token and top-1 agreement on held-out text, the two roundings apart and together, computed on the CPU with
the numerics a W4A8 kernel must reproduce (the quantized operands exact in fp32, fp32 products).

    python benchmarks/w4a8_quality.py --model qwen2.5-coder-1.5b-instruct --problems 16 --keep-bf16 last:2

Rows, each against W4A16 (the NVFP4 weights as stored, 16-bit activations; here fp32):
  weights to e4m3     the weights as a W4A8 kernel decodes them (`qerl.formats.fp8.nvfp4_as_fp8`), activations
                      unrounded
  activations to e4m3 the NVFP4 weights as stored, activations rounded per token (`quantize_rows_fp8`), or with
                      --block B also per 1 x B block of a token (one scale per B features, as blockwise FP8 recipes do)
  W4A8                both
Also the 16-bit model against W4A16, for scale. The target (issue #49): W4A8 within 0.01 nats per token.
"""

import argparse
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F


class _W4A8(torch.nn.Module):
    """A QuantLinear's NVFP4 base computed as W4A8 would be (fp32 products of the quantized operands)."""

    def __init__(self, layer, weights: bool, activations: bool, block: int = 0):
        super().__init__()
        from qerl.formats.fp8 import dequantize_fp8, nvfp4_as_fp8
        from qerl.formats.nvfp4 import dequantize_nvfp4

        tensors = layer.quantized_tensors()
        self.weight = (dequantize_fp8(**nvfp4_as_fp8(**tensors)) if weights else dequantize_nvfp4(**tensors))
        self.bias, self.activations, self.block = layer.bias, activations, block

    def forward(self, x):
        from qerl.formats.fp8 import quantize_rows_fp8

        if self.activations:  # per token, or per 1 x block piece of a token: each piece a "row" of its own
            width = self.block if self.block and x.shape[-1] % self.block == 0 else x.shape[-1]
            q, s = quantize_rows_fp8(x.reshape(-1, width))
            x = (q.float() * s).reshape(x.shape)
        return F.linear(x.float(), self.weight, None if self.bias is None else self.bias.float()).to(x.dtype)


@contextmanager
def w4a8(model, weights: bool, activations: bool, block: int = 0):
    """The model with every NVFP4 QuantLinear replaced by its W4A8 emulation (restored on exit)."""
    from qerl.models.targets import quant_layers

    layers = {n: m for n, m in quant_layers(model).items() if m.weight_format == "nvfp4"}
    try:
        for name, layer in layers.items():
            model.set_submodule(name, _W4A8(layer, weights, activations, block))
        yield model
    finally:
        for name, layer in layers.items():
            model.set_submodule(name, layer)


def main(argv=None) -> int:
    from qerl.eval.fidelity import compare_logprobs, fidelity_text, next_token_logprobs
    from qerl.models import ModelSpec, load_policy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--problems", type=int, default=8, help="held-out GSM8K test problems with solutions")
    ap.add_argument("--keep-bf16", default="", help="comma-separated layers kept 16-bit (e.g. last:2)")
    ap.add_argument("--block", type=int, default=0,
                    help="also rows with activations scaled per 1 x BLOCK piece of a token (e.g. 128)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    keep = tuple(k for k in args.keep_bf16.split(",") if k)
    seen = {}

    def before_quantize(model, tokenizer):  # the 16-bit model's log-probs, the reference of the first row
        seen["ids"] = tokenizer(fidelity_text(args.problems), return_tensors="pt").input_ids
        seen["full"] = next_token_logprobs(model, seen["ids"])

    model, tokenizer = load_policy(ModelSpec(args.model, format="nvfp4", keep_bf16=keep, dtype="fp32", device="cpu"),
                                   before_quantize=before_quantize)
    ids, full = seen["ids"], seen["full"]
    ref = next_token_logprobs(model, ids)
    rows = [("16-bit model", compare_logprobs(ref, full, ids))]
    cases = [("weights to e4m3", True, False, 0), ("activations to e4m3", False, True, 0), ("W4A8", True, True, 0)]
    if args.block:
        cases += [(f"activations to e4m3, 1x{args.block} blocks", False, True, args.block),
                  (f"W4A8, 1x{args.block} blocks", True, True, args.block)]
    for label, weights, activations, block in cases:
        with w4a8(model, weights, activations, block):
            rows.append((label, compare_logprobs(ref, next_token_logprobs(model, ids), ids)))
    print(f"{args.model}, NVFP4 round-to-nearest{' + keep_bf16 ' + args.keep_bf16 if keep else ''}: {ids.shape[1]} "
          f"held-out tokens, CPU fp32, {time.perf_counter() - t0:.0f} s; each row against W4A16")
    print("| against W4A16 | KL (nats/token) | top-1 agreement |")
    print("|---|---:|---:|")
    for label, m in rows:
        print(f"| {label} | {m['kl']:.5f} | {m['top1_agreement']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
