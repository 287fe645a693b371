"""KL(16-bit || quantized + initial adapter) per token on held-out text, for each `lora.init` (zero, loftq, eora):
how much of the quantization error the adapter removes before any RL step.

The held-out text is `qerl.eval.fidelity.fidelity_text` (GSM8K test problems with solutions); eora's calibration
text is `--calibration` (default reasoning-gym, never GSM8K test); `--calibration train --train SOURCE` calibrates on
a training set's problems as `qerl train` does with `model.calibration.source: train` (`auto` mixes both).

    python benchmarks/lora_init_kl.py --model smollm2-135m-instruct --formats nvfp4,mxfp4,nf4 --r 32
    python benchmarks/lora_init_kl.py --model qwen2.5-coder-1.5b-instruct --formats nvfp4 --samples 32 --reload
    python benchmarks/lora_init_kl.py --formats nvfp4 --inits zero,eora --calibration train --train gsm8k-offline:train
    python benchmarks/lora_init_kl.py --model qwen2.5-coder-1.5b-instruct --formats nvfp4 --method awq \
        --keep-bf16 last:2 --calibration train --train gsm8k-offline:train --device cuda   # a config's base

--method (rtn, 4over6, gptq, awq) and --keep-bf16 build the 4-bit base as a training config would (gptq / awq
calibrate on the same text as eora); every row of one format shares that base, so "x zero" is eora's or loftq's
gain on it. --device cuda runs it all in fp32 on the GPU (the 1.5B in about a minute instead of half an hour).

`eora-fisher` (not a `lora.init`: a measurement of whether one is worth building) weights the eora fit on the output
side too: each linear's input covariance C and output-gradient covariance G (gradients of the next-token loss with
labels sampled from the 16-bit model itself, i.e. its Fisher) on the calibration text, both taken on the 16-bit
model in one pass, then s B A = the best rank-r fit of the residual in ||G^(1/2) (R - s B A) C^(1/2)||_F
(`lora_init.residual_factors(output_covariance=G)`, G damped by --output-damp of its mean eigenvalue). Memory: one
[N, N] and one [K, K] fp32 matrix per linear (the 1.5B: about 28 GB).

`--lm-head nvfp4` (a measurement for a 4-bit output head; no config quantizes it) rounds the output head through
NVFP4 in every row, and adds a first row with only the head in 4 bits over the 16-bit body:

    python benchmarks/lora_init_kl.py --model qwen2.5-coder-1.5b-instruct --formats nvfp4 --inits zero \
        --keep-bf16 last:2 --lm-head nvfp4
"""

import argparse
import copy
import time

import torch


def fisher_statistics(model, cal: torch.Tensor, batch: int = 4, seed: int = 0) -> tuple[dict, dict]:
    """({linear name: C = sum x x^T fp32 [K, K]}, {linear name: G = sum g g^T fp32 [N, N]}) over the calibration
    ids [S, T] on the 16-bit `model`: x the linear's inputs, g the gradient of the next-token loss at its outputs with
    labels sampled from the model's own next-token distribution."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    dev = cal.device
    cov = {n: torch.zeros(m.in_features, m.in_features, device=dev) for n, m in linears.items()}
    out = {n: torch.zeros(m.out_features, m.out_features, device=dev) for n, m in linears.items()}

    def hook(name):
        def forward(_module, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            cov[name].addmm_(x.t(), x)

            def backward(g):
                g = g.reshape(-1, g.shape[-1]).float()
                out[name].addmm_(g.t(), g)
            output.register_hook(backward)
        return forward

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    embed = model.get_input_embeddings().weight
    embed.requires_grad_(True)  # so the gradient flows back through the frozen layers
    gen = torch.Generator(device=dev).manual_seed(seed)
    try:
        with torch.enable_grad():
            for i in range(0, cal.shape[0], batch):
                logits = model(input_ids=cal[i:i + batch]).logits[:, :-1].float()
                with torch.no_grad():
                    labels = torch.multinomial(logits.reshape(-1, logits.shape[-1]).softmax(-1), 1, generator=gen)
                torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.view(-1),
                                                  reduction="sum").backward()
    finally:
        for h in handles:
            h.remove()
        embed.requires_grad_(False)
        model.zero_grad(set_to_none=True)
    return cov, out


@torch.no_grad()
def fit_fisher_(model, weights: dict, cov: dict, out: dict, output_damp: float) -> None:
    """Set every 4-bit layer's adapter of `model` to the two-sided fit of its residual against `weights`."""
    from qerl.models import quant_layers
    from qerl.models.lora_init import residual_factors

    for name, layer in quant_layers(model).items():
        if layer.weight_format == "bf16":
            continue
        res = weights[name].to(layer.lora_A.weight.device) - layer.dequantized_weight().float()
        a, b = residual_factors(res, layer.lora_A.weight.shape[0], layer.scaling, cov[name],
                                output_covariance=out[name], output_damp=output_damp)
        layer.lora_A.weight.copy_(a)
        layer.lora_B.weight.copy_(b)


def nvfp4_head_(model) -> None:
    """The output head's weight rounded through NVFP4 (round-to-nearest, one global scale), in place, its dtype kept."""
    from qerl.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:  # tied: the input embedding stays 16-bit
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    head.weight.data = dequantize_nvfp4(**quantize_nvfp4(head.weight.data)).to(head.weight.dtype)


def main():
    from qerl.data import load_problems
    from qerl.eval.fidelity import compare_logprobs, fidelity_text, next_token_logprobs
    from qerl.models import load_causal_lm, quantize_model
    from qerl.models.calibration import calibration_ids
    from qerl.nn import LoraConfig
    from qerl.quant import CALIBRATED

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--formats", default="nvfp4,mxfp4,nf4")
    ap.add_argument("--inits", default="zero,loftq,eora")
    ap.add_argument("--r", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--calibration", default="reasoning-gym")
    ap.add_argument("--train", help="training problems for --calibration train / auto (e.g. gsm8k-offline:train)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--problems", type=int, default=8, help="held-out GSM8K test problems")
    ap.add_argument("--method", default="rtn", help="the base's quantization method (rtn, 4over6, gptq, awq)")
    ap.add_argument("--keep-bf16", default="", help="comma-separated layers left 16-bit, e.g. last:2")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp32 either way)")
    ap.add_argument("--output-damp", type=float, default=1.0, help="eora-fisher: G's damping, x its mean eigenvalue")
    ap.add_argument("--lm-head", choices=("bf16", "nvfp4"), default="bf16",
                    help="nvfp4: the output head rounded through NVFP4 too (and a row with only the head)")
    ap.add_argument("--reload", action="store_true",
                    help="load the model afresh for each row instead of copying it (one 16-bit copy in memory)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    keep = [k for k in args.keep_bf16.split(",") if k]
    base, tok = load_causal_lm(args.model, dtype=torch.float32, device=args.device)
    ids = tok(fidelity_text(args.problems), return_tensors="pt").input_ids.to(args.device)
    ref = next_token_logprobs(base, ids)
    if args.reload:
        del base
    train_rows = load_problems(args.train, split="train") if args.train else None
    cal = calibration_ids(args.calibration, tok, args.samples, args.max_tokens, train_rows=train_rows).to(args.device)
    inits = args.inits.split(",")
    fisher = None
    if "eora-fisher" in inits:
        if args.method == "awq" or args.reload:
            ap.error("eora-fisher: not with --method awq (folded weights) or --reload (it needs the 16-bit model)")
        t0 = time.perf_counter()
        fisher = fisher_statistics(base, cal)
        weights = {n: m.weight.detach().float() for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
        print(f"eora-fisher statistics: {time.perf_counter() - t0:.0f} s")
    source = args.calibration + (f" of {args.train}" if args.train else "")
    print(f"{args.model}: {ids.shape[1]} held-out tokens, calibration {tuple(cal.shape)} ({source}), "
          f"r={args.r} alpha={args.alpha}, base {args.method}" + (f" keep_bf16 {','.join(keep)}" if keep else ""))
    print("| format | init | KL (nats/token) | x zero | top-1 agree | seconds |")
    print("|---|---|---|---|---|---|")
    if args.lm_head == "nvfp4":
        head_only = (load_causal_lm(args.model, dtype=torch.float32, device=args.device)[0] if args.reload
                     else copy.deepcopy(base))
        nvfp4_head_(head_only)
        m = compare_logprobs(ref, next_token_logprobs(head_only, ids), ids)
        print(f"| 16-bit, NVFP4 head | - | {m['kl']:.4f} | - | {m['top1_agreement']:.3f} | - |", flush=True)
        del head_only
    for fmt in args.formats.split(","):
        zero_kl = None
        for init in inits:
            t0 = time.perf_counter()
            lora = LoraConfig(r=args.r, alpha=args.alpha, init="zero" if init == "eora-fisher" else init)
            fresh = (load_causal_lm(args.model, dtype=torch.float32, device=args.device)[0] if args.reload
                     else copy.deepcopy(base))
            calibrated = init == "eora" or args.method in CALIBRATED
            model = quantize_model(fresh, fmt, lora, method=args.method, keep_bf16=keep,
                                   calibration=cal if calibrated else None)
            if init == "eora-fisher":
                fit_fisher_(model, weights, *fisher, args.output_damp)
            if args.lm_head == "nvfp4":
                nvfp4_head_(model)
            secs = time.perf_counter() - t0
            m = compare_logprobs(ref, next_token_logprobs(model, ids), ids)
            zero_kl = m["kl"] if init == "zero" else zero_kl
            ratio = f"{m['kl'] / zero_kl:.2f}" if zero_kl else "-"
            head = ", NVFP4 head" if args.lm_head == "nvfp4" else ""
            print(f"| {fmt}{head} | {init} | {m['kl']:.4f} | {ratio} | {m['top1_agreement']:.3f} | {secs:.0f} |",
                  flush=True)
            del model


if __name__ == "__main__":
    main()
