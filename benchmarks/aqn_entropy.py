"""What AQN's noise does to the policy itself, before any training: the next-token entropy, the KL from the
noise-free policy and the top-1 agreement with it, on fixed GSM8K text (the first problems with their worked
solutions, `qerl.eval.fidelity`), per sigma, over several noise draws. The paper's case for AQN is that the noise
raises the policy's entropy and so its exploration; this measures that direct effect at the schedule's sigmas.

    python benchmarks/aqn_entropy.py --model qwen2.5-coder-1.5b-instruct --format nvfp4 --keep-bf16 last:2 \\
        --sigmas 0,5e-4,2e-3,1e-2,3e-2 --draws 3

Entropy is in nats per token, averaged over the text's positions (teacher-forced, so it is the entropy of the
policy's distributions along reference text, not along its own samples). Runs on the CPU (float32) or a GPU.
"""

import argparse
import datetime
import statistics

import torch


@torch.no_grad()
def measure(model, ids: torch.Tensor, sigma: float, seed: int, clean: torch.Tensor | None,
            relative: bool = False) -> dict:
    """One forward with noise of std `sigma` (draw `seed`) in the norms: mean entropy, and against the clean
    log-probs `clean` (float32 [1, T, V]) the mean KL(clean || noisy) and top-1 agreement."""
    from qerl.eval.fidelity import next_token_logprobs
    from qerl.nn.noisy_norm import NoisyNorms

    with NoisyNorms(model, sigma, seed=seed, relative=relative):
        logp = next_token_logprobs(model, ids)
    out = {"entropy": -(logp.exp() * logp).sum(-1).mean().item(), "logp": logp}
    if clean is not None:
        out["kl"] = (clean.exp() * (clean - logp)).sum(-1).mean().item()
        out["top1"] = (clean.argmax(-1) == logp.argmax(-1)).float().mean().item()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--format", default="nvfp4", help="bf16 or a 4-bit format, quantized round-to-nearest")
    ap.add_argument("--keep-bf16", default="", help="comma list of model.keep_bf16 patterns, e.g. last:2")
    ap.add_argument("--sigmas", default="0,5e-4,2e-3,1e-2,3e-2")
    ap.add_argument("--relative", action="store_true", help="noise std sigma * |w| per channel (aqn.relative)")
    ap.add_argument("--draws", type=int, default=3, help="noise draws per sigma > 0")
    ap.add_argument("--problems", type=int, default=4, help="GSM8K problems with solutions in the text")
    ap.add_argument("--max-tokens", type=int, default=768)
    args = ap.parse_args(argv)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    if any(s < 0 for s in sigmas) or args.draws < 1:
        ap.error("--sigmas must be >= 0 and --draws >= 1")

    from qerl.eval.fidelity import fidelity_text
    from qerl.models import ModelSpec, load_policy
    from qerl.models.precision import parse_keep_bf16
    from qerl.nn.noisy_norm import find_noisy_norms

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quantized = args.format != "bf16"
    model, tok = load_policy(ModelSpec(args.model, format=args.format if quantized else None,
                                       keep_bf16=tuple(parse_keep_bf16(args.keep_bf16)) if quantized else (),
                                       dtype="bf16" if device.type == "cuda" else "fp32", device=device))
    ids = tok(fidelity_text(args.problems), return_tensors="pt").input_ids[:, :args.max_tokens].to(device)
    # the noise scales each consumer column by (1 + z_j / w_j): its effect depends on the norm weights' size
    w = torch.cat([n.weight.detach().float().abs().flatten() for n in find_noisy_norms(model)])
    clean = measure(model, ids, 0.0, 0, None)
    rows = []
    for sigma in sigmas:
        draws = [clean] if sigma == 0 else [measure(model, ids, sigma, d, clean["logp"], args.relative)
                                              for d in range(args.draws)]
        ent = [d["entropy"] for d in draws]
        rows.append({"sigma": sigma, "entropy": statistics.fmean(ent),
                     "entropy_std": statistics.stdev(ent) if len(ent) > 1 else 0.0,
                     "kl": statistics.fmean(d.get("kl", 0.0) for d in draws),
                     "top1": statistics.fmean(d.get("top1", 1.0) for d in draws)})
        print(rows[-1], flush=True)
    keep = (f", keep_bf16 {args.keep_bf16}" if args.keep_bf16 else "") + (", relative noise" if args.relative else "")
    print(f"\n{args.model}, {args.format}{keep}; {device.type} ({torch.__version__}), {datetime.date.today()}; "
          f"{ids.shape[1]} tokens of GSM8K text ({args.problems} problems), {args.draws} noise draws per sigma; "
          f"noised norm weights |w|: median {w.median():.3f}, 10th percentile {w.quantile(0.1):.3f}")
    print("| sigma | entropy (nats/token) | vs sigma 0 | KL(clean ‖ noisy) | top-1 agreement |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        spread = f" ± {r['entropy_std']:.4f}" if r["sigma"] > 0 and args.draws > 1 else ""
        print(f"| {r['sigma']:g} | {r['entropy']:.4f}{spread} | {r['entropy'] - clean['entropy']:+.4f} | "
              f"{r['kl']:.4f} | {r['top1']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
