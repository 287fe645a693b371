"""Where a trained adapter loses on its 4-bit base: the same adapter on the 16-bit model and on the 4-bit one,
greedy, problem by problem, position by position and layer by layer.

    python benchmarks/base_gap.py qwen2.5-coder-1.5b-instruct --adapter RUN/adapter --format nvfp4 \\
        --keep-bf16 last:2 --dataset gsm8k-offline:heldout --limit 200 --keep-sweep 2,4 --out gap.json

Per problem: both greedy completions (<= --max-new-tokens), their lengths, flexible and strict correctness, and the
first token where they differ (None: identical). Along the 16-bit completion (teacher-forced, so both models see
the same prefix): per position the KL(16-bit || 4-bit) of the next-token distributions and whether their top
tokens agree, averaged in position bins. Per decoder layer, on the first --layer-problems problems: the same KL with
that one layer taken from the 16-bit model (the 4-bit model otherwise), so the layers whose 4-bit error costs the
most stand out; then the KL with the top 1, 2, 4, 8 of them together (what `model.keep_bf16` would keep). With
--keep-sweep K,...: the greedy pass@1 of the 4-bit policy with its top K layers taken from the 16-bit model, on all
the problems (what serving the trained adapter with those layers in bf16 would score).

The tables go to stdout, everything to --out (JSON).
"""

import argparse
import json
import math
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

POSITION_BINS = (0, 16, 64, 128, 256, 512, 1 << 30)  # completion positions [a, b)


def greedy(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch: int = 32) -> list[list[int]]:
    """Each prompt's greedy completion token ids (EOS included when reached), through qerl's rollout engine."""
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    engine = RolloutEngine(model, tokenizer, max_seq_len=max(map(len, prompts)) + max_new_tokens)
    out = []
    for start in range(0, len(prompts), batch):
        r = engine.generate(prompts[start:start + batch], max_new_tokens, SamplingParams(temperature=0.0), seed=0)
        out += [ids[:n].tolist() for ids, n in zip(r.completion_ids.cpu(), r.completion_mask.sum(1).tolist())]
    engine.release_memory()
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (one ending earlier counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def next_token_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(. | prompt + completion[:t]) for t = 0..T-1: fp32 [T, V] on the model's device."""
    ids = torch.tensor([prompt + completion], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1)


def kl_and_agreement(ref: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ref, other: log-probs [T, V] -> (KL(ref || other) [T] fp32, top-1 agreement [T] bool)."""
    kl = (ref.exp() * (ref - other)).sum(-1)
    return kl.clamp(min=0.0), ref.argmax(-1) == other.argmax(-1)


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.model.layers


@contextmanager
def layers_from(model, source, indices):
    """Run `model` with its decoder layers `indices` replaced by `source`'s (the same architecture)."""
    layers, theirs = decoder_layers(model), decoder_layers(source)
    saved = {i: layers[i] for i in indices}
    try:
        for i in indices:
            layers[i] = theirs[i]
        yield model
    finally:
        for i, layer in saved.items():
            layers[i] = layer


def mean_kl(model, references: list[tuple[list[int], list[int], torch.Tensor]]) -> float:
    """Token-mean KL(reference || model) over (prompt, completion, reference log-probs) triples."""
    total, n = 0.0, 0
    for prompt, completion, ref in references:
        if completion:
            kl, _ = kl_and_agreement(ref, next_token_logprobs(model, prompt, completion))
            total, n = total + float(kl.sum()), n + kl.numel()
    return total / max(n, 1)


def layer_sweep(quantized, full, references) -> dict:
    """{"none": KL of the 4-bit model, "per_layer": [KL with layer i 16-bit], "top": [(k, layers, KL)]}."""
    none = mean_kl(quantized, references)
    per_layer = []
    for i in range(len(decoder_layers(quantized))):
        with layers_from(quantized, full, [i]):
            per_layer.append(mean_kl(quantized, references))
    ranked = sorted(range(len(per_layer)), key=per_layer.__getitem__)
    top = []
    for k in (1, 2, 4, 8):
        if k <= len(ranked):
            with layers_from(quantized, full, ranked[:k]):
                top.append({"k": k, "layers": sorted(ranked[:k]), "kl": mean_kl(quantized, references)})
    return {"none": none, "per_layer": per_layer, "top": top}


def position_table(kls: list[torch.Tensor], agree: list[torch.Tensor]) -> list[dict]:
    rows = []
    for a, b in zip(POSITION_BINS, POSITION_BINS[1:]):
        k = [x[a:b] for x in kls if x.numel() > a]
        g = [x[a:b] for x in agree if x.numel() > a]
        if k:
            k, g = torch.cat(k), torch.cat(g)
            rows.append({"from": a, "to": b, "tokens": k.numel(), "kl": float(k.mean()),
                         "top1_agree": float(g.float().mean())})
    return rows


def keep_sweep(quantized, full, tokenizer, prompts, rows, style, max_new_tokens: int, ranked: list[int],
               sizes: list[int]) -> list[dict]:
    """Per k in `sizes`: {"k", "layers", "pass1", "pass1_strict"} of the 4-bit policy with the layers ranked[:k] (most
    KL recovered first) taken from the 16-bit model, greedy on every prompt."""
    from qerl.rewards.scores import score_all

    out = []
    for k in sizes:
        layers = sorted(ranked[:k])
        with layers_from(quantized, full, layers):
            done = greedy(quantized, tokenizer, prompts, max_new_tokens)
        s = score_all(tokenizer.batch_decode(done, skip_special_tokens=True), [r["answer"] for r in rows], style)
        out.append({"k": k, "layers": layers, "pass1": statistics.mean(bool(x.flexible) for x in s),
                    "pass1_strict": statistics.mean(bool(x.strict) for x in s)})
    return out


def analyse(full, quantized, tokenizer, rows: list[dict], suffix, max_new_tokens: int, layer_problems: int,
            keep_sizes: list[int] = ()) -> dict:
    """The whole analysis (module docstring) of `rows` ({"question", "answer"}) on the 16-bit policy `full` and the
    4-bit one `quantized` (the same adapter on both); keep_sizes: the --keep-sweep (needs the layer sweep)."""
    from qerl.data.templates import build_prompt, encode_prompt, requested_style
    from qerl.rewards.scores import score_all

    prompts = [encode_prompt(build_prompt(r["question"], tokenizer, suffix), tokenizer) for r in rows]
    done = {name: greedy(m, tokenizer, prompts, max_new_tokens) for name, m in (("16bit", full), ("4bit", quantized))}
    texts = {name: tokenizer.batch_decode(c, skip_special_tokens=True) for name, c in done.items()}
    style = requested_style(suffix)
    scores = {name: score_all(t, [r["answer"] for r in rows], style) for name, t in texts.items()}
    problems, kls, agree, references = [], [], [], []
    for i, prompt in enumerate(prompts):
        a, b = done["16bit"][i], done["4bit"][i]
        ref = next_token_logprobs(full, prompt, a) if a else None
        if ref is not None:
            kl, ag = kl_and_agreement(ref, next_token_logprobs(quantized, prompt, a))
            kls.append(kl.cpu())
            agree.append(ag.cpu())
            if len(references) < layer_problems:
                references.append((prompt, a, ref))
        problems.append({"length_16bit": len(a), "length_4bit": len(b), "diverge_at": first_divergence(a, b),
                         **{f"{k}_{name}": getattr(scores[name][i], k) for name in scores
                            for k in ("flexible", "strict")}})
    correct = {name: [bool(p[f"flexible_{name}"]) for p in problems] for name in done}
    diverged = [p["diverge_at"] for p in problems if p["diverge_at"] is not None]
    summary = {
        "problems": len(problems),
        **{f"pass1_{name}": statistics.mean(correct[name]) for name in done},
        **{f"pass1_strict_{name}": statistics.mean(bool(p[f"strict_{name}"]) for p in problems) for name in done},
        "both": sum(x and y for x, y in zip(correct["16bit"], correct["4bit"])),
        "only_16bit": sum(x and not y for x, y in zip(correct["16bit"], correct["4bit"])),
        "only_4bit": sum(y and not x for x, y in zip(correct["16bit"], correct["4bit"])),
        "identical": len(problems) - len(diverged),
        "median_diverge_at": statistics.median(diverged) if diverged else None,
        **{f"mean_length_{name}": statistics.mean(len(c) for c in done[name]) for name in done},
    }
    layers = layer_sweep(quantized, full, references) if references else None
    kept = []
    if layers and keep_sizes:
        ranked = sorted(range(len(layers["per_layer"])), key=layers["per_layer"].__getitem__)
        kept = keep_sweep(quantized, full, tokenizer, prompts, rows, style, max_new_tokens, ranked, keep_sizes)
    return {"summary": summary, "positions": position_table(kls, agree), "layers": layers, "keep_sweep": kept,
            "problems": problems}


def report(result: dict) -> str:
    s = result["summary"]
    lines = [f"{s['problems']} problems, greedy: pass@1 16-bit {s['pass1_16bit']:.3f} / 4-bit {s['pass1_4bit']:.3f} "
             f"(strict {s['pass1_strict_16bit']:.3f} / {s['pass1_strict_4bit']:.3f}); both right {s['both']}, only "
             f"16-bit {s['only_16bit']}, only 4-bit {s['only_4bit']}; identical completions {s['identical']}, "
             f"median first difference at token {s['median_diverge_at']}; mean length {s['mean_length_16bit']:.0f} / "
             f"{s['mean_length_4bit']:.0f} tokens",
             "", "| positions | tokens | KL(16-bit ‖ 4-bit) | top-1 agreement |", "|---|---:|---:|---:|"]
    for r in result["positions"]:
        to = "end" if r["to"] >= 1 << 30 else r["to"] - 1
        lines.append(f"| {r['from']}-{to} | {r['tokens']} | {r['kl']:.4f} | {r['top1_agree']:.3f} |")
    layers = result["layers"]
    if layers:
        none = layers["none"]
        lines += ["", f"all layers 4-bit: KL {none:.4f}", "| 16-bit layer(s) | KL | recovered |", "|---|---:|---:|"]
        best = sorted(range(len(layers["per_layer"])), key=layers["per_layer"].__getitem__)[:8]
        for i in best:
            kl = layers["per_layer"][i]
            lines.append(f"| {i} | {kl:.4f} | {1 - kl / none if none else math.nan:.1%} |")
        for t in layers["top"]:
            lines.append(f"| top {t['k']}: {','.join(map(str, t['layers']))} | {t['kl']:.4f} | "
                         f"{1 - t['kl'] / none if none else math.nan:.1%} |")
    if result.get("keep_sweep"):
        s = result["summary"]
        lines += ["", "| layers from the 16-bit model | greedy pass@1 | strict |", "|---|---:|---:|",
                  f"| none (the 4-bit policy) | {s['pass1_4bit']:.3f} | {s['pass1_strict_4bit']:.3f} |"]
        for t in result["keep_sweep"]:
            lines.append(f"| top {t['k']}: {','.join(map(str, t['layers']))} | {t['pass1']:.3f} | "
                         f"{t['pass1_strict']:.3f} |")
        lines.append(f"| all (the 16-bit policy) | {s['pass1_16bit']:.3f} | {s['pass1_strict_16bit']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the 16-bit model (embedded name, HF directory, GGUF file or hub id)")
    ap.add_argument("--adapter", required=True, help="the trained PEFT adapter (a run's adapter/)")
    ap.add_argument("--format", default="nvfp4", help="the 4-bit base's format")
    ap.add_argument("--method", default="rtn", help="its quantization method (rtn, 4over6, gptq, awq)")
    ap.add_argument("--keep-bf16", default="", help="comma-separated layers kept 16-bit in the 4-bit base")
    ap.add_argument("--dataset", default="gsm8k-offline:heldout")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--suffix", default="gsm8k")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--layer-problems", type=int, default=16, help="problems of the per-layer sweep (0: none)")
    ap.add_argument("--keep-sweep", default="", help="comma-separated k: greedy pass@1 with the top k layers of the "
                                                      "sweep from the 16-bit model (e.g. 2,4)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from qerl.data import load_problems
    from qerl.models.loader import ModelSpec, load_policy

    rows = load_problems(args.dataset, split=args.split, limit=args.limit)
    keep = tuple(k for k in args.keep_bf16.split(",") if k)
    full, tokenizer = load_policy(ModelSpec(name=args.model, format="bf16", adapter=args.adapter, device=args.device))
    quantized, _ = load_policy(ModelSpec(name=args.model, format=args.format, method=args.method, keep_bf16=keep,
                                         adapter=args.adapter, device=args.device))
    try:
        keep_sizes = [int(k) for k in args.keep_sweep.split(",") if k.strip()]
    except ValueError:
        ap.error(f"--keep-sweep {args.keep_sweep!r}: comma-separated layer counts, e.g. 2,4")
    if any(k < 1 for k in keep_sizes) or (keep_sizes and args.layer_problems < 1):
        ap.error("--keep-sweep: counts >= 1, and it needs the layer sweep (--layer-problems >= 1)")
    result = analyse(full.eval(), quantized.eval(), tokenizer, rows, args.suffix, args.max_new_tokens,
                     args.layer_problems, keep_sizes)
    result["args"] = vars(args)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
