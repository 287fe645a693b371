"""Policy bytes of Qwen2.5-shaped models, computed on the meta device (no GPU, no weights, seconds on a CPU).

The model is built by transformers on `meta`; every target linear becomes a real `QuantLinear` (+ LoRA) and,
with the option, the input embedding a real `QuantEmbedding`, holding meta tensors of exactly the shapes and
dtypes the format's quantizer returns (checked against a real quantization of one row). Then the same
`memory_report` and `policy_bytes` (`qerl.models.memory`, as `qerl bench rollout` counts them) count the bytes.

    python benchmarks/policy_size.py --models 7b,14b,32b --formats nvfp4 --lora-r 16
"""

import argparse

import torch

from qerl.models.memory import policy_bytes
from qerl.models.shapes import QWEN25, qwen25_config
from qerl.formats import get_format
from qerl.models.memory import memory_report
from qerl.models.targets import find_targets
from qerl.nn import DEFAULT_TARGETS, LoraConfig, QuantEmbedding, QuantLinear
from qerl.nn.quant_embedding import _PER_TENSOR


def meta_tensors(fmt: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like `get_format(fmt).quantize(W [n, k])`: derived from a real 1-row quantization."""
    one = get_format(fmt).quantize(torch.ones(1, k), None)
    out = {}
    for name, t in one.items():
        if name in _PER_TENSOR:
            shape = t.shape
        else:  # per row: [1, c] -> [n, c]; flat [c] -> [n * c]
            shape = (n, *t.shape[1:]) if t.ndim > 1 else (n * t.numel(),)
        out[name] = torch.empty(shape, dtype=t.dtype, device="meta")
    return out


def meta_policy(size: str, fmt: str, lora_r: int, embeddings: bool):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen25_config(size), dtype=torch.bfloat16)
    lora = LoraConfig(r=lora_r, alpha=2 * lora_r) if lora_r else None
    for name, lin in find_targets(model, DEFAULT_TARGETS).items():
        bias = None if lin.bias is None else torch.empty_like(lin.bias)
        model.set_submodule(name, QuantLinear(lin.in_features, lin.out_features, fmt,
                                            meta_tensors(fmt, lin.out_features, lin.in_features), bias, lora))
    if embeddings:
        emb = model.get_input_embeddings()
        V, D = emb.weight.shape
        model.set_input_embeddings(QuantEmbedding(V, D, fmt, meta_tensors(fmt, V, D), emb.weight.dtype))
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b", help=f"comma list of {','.join(QWEN25)}")
    ap.add_argument("--formats", default="nvfp4", help="comma list of nvfp4,mxfp4,nf4")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank on all 7 linears (fp32); 0 = none")
    args = ap.parse_args(argv)
    print("| model | format | input embedding | quantized base GB | other GB | LoRA GB | policy GB "
          "| read per step GB |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.models.split(","):
        for fmt in args.formats.split(","):
            for embeddings in (False, True):
                model = meta_policy(size, fmt, args.lora_r, embeddings)
                rep = memory_report(model)
                read, total = policy_bytes(model)
                assert total == rep["total_bytes"]
                print(f"| {size} | {fmt} | {fmt if embeddings else 'bf16'} | {rep['quantized_bytes'] / 1e9:.3f} "
                      f"| {rep['other_bytes'] / 1e9:.3f} | {rep['lora_bytes'] / 1e9:.3f} | {total / 1e9:.3f} "
                      f"| {read / 1e9:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
