"""Does a 4-bit base change the first LoRA update? The LoRA gradient on a bf16 base against the one on a 4-bit
base, same adapter initialisation, same text.

    python experiments/lora_grad_agreement.py --model qwen2.5-coder-1.5b-instruct --format nvfp4 --keep-bf16 last:2

The loss is the mean token log-likelihood of GSM8K training-split worked solutions given their questions (the
chat template and the `gsm8k` suffix, as in training): the direction a policy-gradient step takes on correct
completions. At initialisation LoRA B is zero, so only B has a gradient (B's gradient is the first update).
Two disjoint problem sets (A, B) give two gradients per base. Printed: the cosine between the bf16-base and the
4-bit-base gradients on the same set (global over all LoRA B weights, and the median over modules), their norm
ratio, and as the scale of "different" the cosine between the two sets' gradients on the bf16 base. One model is
resident at a time; CPU float32 (or a GPU in bf16).
"""

import argparse
import datetime
import gc
import statistics

import torch


def problem_batch(tok, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [n, T], loss mask float [n, T]: 1 on the solution's tokens), right-padded. The prompt is the
    training one (`build_prompt`: chat template, `gsm8k` suffix); the solution is GSM8K's worked answer."""
    from qerl.data import build_prompt, encode_prompt

    seqs, masks = [], []
    for r in rows:
        p = encode_prompt(build_prompt(r["question"], tok), tok)
        a = tok(r["answer"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append(p + a)
        masks.append([0.0] * len(p) + [1.0] * len(a))
    t = max(map(len, seqs))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([s + [pad] * (t - len(s)) for s in seqs])
    mask = torch.tensor([m + [0.0] * (t - len(m)) for m in masks])
    return ids, mask


def lora_b_grads(model, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """{LoRA B parameter name: fp32 gradient} of the mean masked next-token NLL (one sequence at a time)."""
    from qerl.models import lora_parameters

    params = {n: p for n, p in lora_parameters(model).items() if ".lora_B." in n}
    for p in params.values():
        p.grad = None
    device = next(model.parameters()).device
    total = mask[:, 1:].sum()
    for i in range(ids.shape[0]):
        x, m = ids[i:i + 1].to(device), mask[i:i + 1, 1:].to(device)
        logits = model(input_ids=x).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        ((nll * m).sum() / total).backward()
    return {n: p.grad.detach().float().cpu().clone() for n, p in params.items()}


def cosine(a: dict, b: dict, names=None) -> float:
    names = names or a.keys()
    dot = sum((a[n] * b[n]).sum() for n in names)
    na = sum((a[n] ** 2).sum() for n in names).sqrt()
    nb = sum((b[n] ** 2).sum() for n in names).sqrt()
    return (dot / (na * nb)).item()


def median_module_cosine(a: dict, b: dict) -> float:
    return statistics.median(cosine(a, b, [n]) for n in a)


def norm(a: dict) -> float:
    return sum((v ** 2).sum() for v in a.values()).sqrt().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--format", default="nvfp4", help="the 4-bit format to compare with bf16 (round-to-nearest)")
    ap.add_argument("--keep-bf16", default="", help="model.keep_bf16 of the 4-bit base, e.g. last:2")
    ap.add_argument("--problems", type=int, default=4, help="GSM8K training-split problems per set (two sets)")
    ap.add_argument("--r", type=int, default=32, help="LoRA rank (alpha = 2 r, as configs/gsm8k-grpo-1.5b.yaml)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.problems < 1:
        ap.error("--problems must be >= 1")
    if args.format == "bf16":
        ap.error("--format: a 4-bit format to compare with bf16 (nvfp4, mxfp4, nf4)")

    from qerl.data.offline import gsm8k_train_offline
    from qerl.models import load_causal_lm, lora_parameters
    from qerl.models.convert import quantize_model
    from qerl.models.precision import parse_keep_bf16
    from qerl.nn.lora import LoraConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = gsm8k_train_offline()
    sets = {"A": rows[:args.problems], "B": rows[args.problems:2 * args.problems]}
    grads, lora_a = {}, {}
    for fmt in ("bf16", args.format):
        model, tok = load_causal_lm(args.model, dtype="bf16" if device.type == "cuda" else "fp32", device=device)
        torch.manual_seed(args.seed)  # the same LoRA A on both bases (B starts at zero)
        quantize_model(model, fmt, lora=LoraConfig(r=args.r, alpha=2.0 * args.r),
                       keep_bf16=parse_keep_bf16(args.keep_bf16) if fmt != "bf16" else ())
        model.eval()  # no dropout; gradients still flow
        a_init = {n: p.detach().float().cpu().clone() for n, p in lora_parameters(model).items() if ".lora_A." in n}
        if "A" not in lora_a:
            lora_a["A"] = a_init
        elif a_init.keys() != lora_a["A"].keys() or any(not torch.equal(a_init[n], lora_a["A"][n]) for n in a_init):
            raise SystemExit(f"LoRA A on the {fmt} base differs from the bf16 base's: the comparison needs one "
                             "initialisation")
        for name, problems in sets.items():
            ids, mask = problem_batch(tok, problems)
            grads[fmt, name] = lora_b_grads(model, ids, mask)
            print(f"{fmt} set {name}: {ids.shape[0]} sequences, {int(mask.sum())} solution tokens, "
                  f"|grad B| {norm(grads[fmt, name]):.4g}", flush=True)
        del model
        gc.collect()

    q = args.format
    print(f"\n{args.model}; bf16 vs {q}" + (f" (keep_bf16 {args.keep_bf16})" if args.keep_bf16 else "") +
          f"; LoRA r {args.r}, seed {args.seed}; {args.problems} GSM8K training-split problems per set; "
          f"{device.type} ({torch.__version__}), {datetime.date.today()}\n")
    print("| gradients compared | cosine (all LoRA B) | median cosine per module | norm ratio |")
    print("|---|---:|---:|---:|")
    for name in sets:
        a, b = grads["bf16", name], grads[q, name]
        print(f"| set {name}: bf16 base vs {q} base | {cosine(a, b):.4f} | {median_module_cosine(a, b):.4f} | "
              f"{norm(b) / norm(a):.3f} |")
    a, b = grads["bf16", "A"], grads["bf16", "B"]
    print(f"| bf16 base: set A vs set B (other problems) | {cosine(a, b):.4f} | {median_module_cosine(a, b):.4f} | "
          f"{norm(b) / norm(a):.3f} |")
    a, b = grads[q, "A"], grads[q, "B"]
    print(f"| {q} base: set A vs set B | {cosine(a, b):.4f} | {median_module_cosine(a, b):.4f} "
          f"| {norm(b) / norm(a):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
