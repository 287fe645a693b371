"""Host work of one loss pass: the aten ops one forward + backward of the completion log-probs issues, per policy
variant, on a tiny random Qwen2 (CPU, float32; `torch.profiler`). At small model sizes the update is bound by
launching kernels, so a variant that issues more ops per pass is slower for that reason alone; this tells that
apart from the kernels' own speed.

    python experiments/loss_pass_ops.py --variants bf16,nvfp4+dense

A variant is FORMAT[+dense] (+dense: the 16-bit weight copies of `model.dense_weights`). A 4-bit variant
without +dense runs the CPU's plain-torch dequantize-per-call path here, not the GPU kernels: its count says
nothing about the GPU.
"""

import argparse
import collections
import datetime

import torch


def count_ops(variant: str, layers: int, tokens: int) -> collections.Counter:
    """aten op name -> calls in the second forward + backward (the first one makes any copies)."""
    from transformers import Qwen2Config

    from qerl.kernels import dequantized_weights
    from qerl.models import Quantization
    from qerl.models.random_weights import random_policy
    from qerl.nn import LoraConfig
    from qerl.rl.logprobs import completion_logprobs

    fmt, _, flag = variant.partition("+")
    if flag not in ("", "dense"):
        raise SystemExit(f"unknown variant {variant!r}: FORMAT[+dense]")
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    q = Quantization.of(fmt, lora=LoraConfig(r=8, alpha=16))
    model = random_policy(cfg, q, torch.device("cpu")).to(torch.float32).train()
    g = torch.Generator().manual_seed(0)
    prompt, completion = (torch.randint(1, 500, (2, tokens), generator=g) for _ in range(2))
    mask = torch.ones_like(prompt, dtype=torch.bool)
    store = {} if flag == "dense" else None

    def loss_pass():
        with dequantized_weights(enabled=store is not None, store=store):
            completion_logprobs(model, prompt, mask, completion, mask).sum().backward()

    loss_pass()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_pass()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="bf16,nvfp4+dense")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8, help="prompt and completion tokens per row (2 rows)")
    args = ap.parse_args(argv)
    counts = {v: count_ops(v, args.layers, args.tokens) for v in args.variants.split(",")}
    base = args.variants.split(",")[0]
    print(f"CPU, torch {torch.__version__}, {datetime.date.today()}; tiny Qwen2, {args.layers} layers, "
          f"2 x ({args.tokens} + {args.tokens}) tokens, LoRA r 8")
    print("| variant | aten ops | vs " + base + " | most different ops |")
    print("|---|---:|---:|---|")
    for v, c in counts.items():
        diff = {k: c[k] - counts[base].get(k, 0) for k in set(c) | set(counts[base])}
        top = ", ".join(f"{k} {d:+d}" for k, d in sorted(diff.items(), key=lambda x: -abs(x[1]))[:3] if d)
        print(f"| {v} | {sum(c.values())} | {sum(c.values()) - sum(counts[base].values()):+d} | {top or '-'} |")


if __name__ == "__main__":
    main()
