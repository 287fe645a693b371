"""Quantization methods side by side on a real model: weight error, next-token KL to the unquantized model on
held-out text, starting pass@1 on held-out problems, the share of short completions, quantization time.

A row is FORMAT[-METHOD][@SOURCE][#KEEP|KEEP...] (KEEP: a `keep_bf16` pattern left in bf16, e.g. last:2; bf16,
nf4, mxfp4, nvfp4, nvfp4-4over6, nvfp4-gptq, nvfp4-awq@self, ...;
SOURCE is a calibration source of qerl.data.calibration), nvfp4-4over6~SEARCH (another candidate set of
`qerl.quant.nvfp4_scales.candidate_scales`: 4over6 = only the maximum onto 6 or 4) or a diagnostic row:
  only:LAYER:FORMAT   quantize only one layer type (q_proj, ..., down_proj) to FORMAT (rtn), rest 16-bit
  fake:e4m3-free      NVFP4 codes with block scales kept in fp32 (no E4M3 rounding of the scale)
  fake:e2m1+5         NVFP4 on a grid that also has 5 (no gap between 4 and 6)
The held-out text is GSM8K test problems with their solutions (never calibration); pass@1 is on --test
(question/answer JSONL, a reasoning-gym spec or any qerl dataset source) with --n samples at --temperature
(default 0.6, top-p 0.95; 0 is greedy).

    # GPU (H100/H200): the table in docs/formats.md
    python benchmarks/quant_methods.py --model /tmp/smol-hf --test .gpu/data/arith_test.jsonl --limit 200 \
        --rows bf16,nf4,mxfp4,nvfp4,nvfp4-4over6,nvfp4-gptq,nvfp4-awq --out /tmp/qm.json
    # GPU: the starting point of a real model on the GSM8K held-out problems (first 500), greedy, <= 512 tokens
    python benchmarks/quant_methods.py --model /tmp/q15 --test gsm8k-offline --limit 500 --n 1 --temperature 0 \
        --max-new-tokens 512 --batch-size 128 --rows bf16,nf4,nvfp4,nvfp4-4over6,nvfp4-gptq,nvfp4-awq
    # CPU: KL and time only (pass@1 needs a GPU to be quick)
    python benchmarks/quant_methods.py --rows nvfp4,nvfp4-gptq --no-eval
    # GPU: quantization time at 7B (4 of 28 layers, extrapolated)
    python benchmarks/quant_methods.py --time-7b 4 --rows rtn,4over6,gptq,awq
"""

import argparse
import dataclasses
import copy
import json
import re
import time
from pathlib import Path

import torch


def parse_row(row: str) -> tuple[str, str, str | None, list[str]]:
    """'nvfp4-gptq@self#last:2|*.down_proj' -> ("nvfp4", "gptq", "self", ["last:2", "*.down_proj"])."""
    row, _, keep = row.partition("#")
    spec, _, source = row.partition("@")
    fmt, _, method = spec.partition("-")
    return fmt, method or "rtn", source or None, [k for k in keep.split("|") if k]


def quantize_row(base, tok, row: str, cal_cfg: dict, device) -> tuple[torch.nn.Module, float, dict]:
    """A fresh copy of `base` quantized as `row`; (model, seconds, info)."""
    from qerl.formats import get_format
    from qerl.models.calibration import calibrated_quantize, calibration_ids
    from qerl.models.convert import quantize_model
    from qerl.models.precision import resolve_keep_bf16
    from qerl.models.quantization import Quantization
    from qerl.models.surgery import method_quantizer
    from qerl.models.targets import find_targets
    from qerl.nn import DEFAULT_TARGETS
    from qerl.quant import CALIBRATED

    model = copy.deepcopy(base)
    if row.startswith(("only:", "fake:")):
        t0 = time.perf_counter()
        explain_rows(model, row)
        return model, time.perf_counter() - t0, {}
    fmt, method, source, keep = parse_row(row)
    t0 = time.perf_counter()
    info = {}
    if keep:
        info["kept_bf16"] = len(resolve_keep_bf16(model, keep))
    if "~" in method:  # nvfp4-4over6~4over6: the scale search with another candidate set (nvfp4_scales)
        method, _, search = method.partition("~")
        linears = find_targets(model, DEFAULT_TARGETS)
        quantize_model(model, fmt, quantizer=method_quantizer(model, linears, get_format(fmt), method, search=search))
    elif method in CALIBRATED:
        ids = calibration_ids(source or cal_cfg["source"], tok, cal_cfg["samples"], cal_cfg["max_tokens"], model=base)
        info["calibration_s"] = time.perf_counter() - t0
        info["calibration_tokens"] = ids.numel()
        out = calibrated_quantize(model, Quantization.of(fmt, method, calibration=ids), device=device,
                                  keep=resolve_keep_bf16(model, keep) if keep else ())
        info["awq_scales"] = out["awq_scales"]
    else:
        quantize_model(model, fmt, method=method, keep_bf16=keep)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return model, time.perf_counter() - t0, info


@torch.no_grad()
def explain_rows(model, row: str) -> None:
    """Diagnostic rows, in place on a dense model (see the module docstring)."""
    from qerl.formats.nvfp4 import E4M3_MAX
    from qerl.models.convert import quantize_model
    from qerl.models.surgery import shared_global_scales
    from qerl.models.targets import find_targets
    from qerl.nn import DEFAULT_TARGETS

    kind, _, rest = row.partition(":")
    if kind == "only":
        leaf, _, fmt = rest.partition(":")
        quantize_model(model, fmt or "nvfp4", targets=[leaf])
        return
    linears = find_targets(model, DEFAULT_TARGETS)
    scales = shared_global_scales(linears, "nvfp4")
    grid = {"e4m3-free": torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6]),
            "e2m1+5": torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 5, 6])}[rest]
    for name, lin in linears.items():
        w = lin.weight.float()
        n, k = w.shape
        blocks = w.reshape(n, k // 16, 16)
        gs = scales[name].to(w.device)
        scale = gs * blocks.abs().amax(-1, keepdim=True) / 6
        if rest == "e2m1+5":  # the stored E4M3 scale, only the element grid changes
            scale = scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        scale = torch.where(scale == 0, torch.full_like(scale, 0.125), scale)
        step = scale / gs
        x = (blocks / step).clamp(-6, 6)
        g = grid.to(w.device)
        nearest = g[(x.abs().unsqueeze(-1) - g).abs().argmin(-1)] * x.sign()
        lin.weight.copy_((nearest * step).reshape(n, k).to(lin.weight.dtype))


def weight_error(base, model) -> float | None:
    """sqrt(sum ||W - deq||^2 / sum ||W||^2) over the quantized linears (None when nothing is quantized)."""
    from qerl.models.targets import quant_layers

    num = den = 0.0
    layers = quant_layers(model)
    for name, layer in layers.items():
        if layer.weight_format == "bf16":
            continue
        w = base.get_submodule(name).weight.float()
        num += float((w - layer.dequantized_weight().to(w.device)).square().sum())
        den += float(w.square().sum())
    return (num / den) ** 0.5 if den else None


def time_qwen7b(layers: int, methods: list[str], samples: int, max_tokens: int) -> None:
    """Seconds to build + quantize a Qwen2.5-7B-shaped model (random weights, `layers` of its 28 decoder
    layers) with each method through the streaming loader, and the 28-layer extrapolation."""
    from qerl.models import ModelSpec, load_policy

    spec = ModelSpec(f"random:qwen2.5-7b,layers={layers}", format="nvfp4", calibration_samples=samples,
                     calibration_max_tokens=max_tokens, dtype="bf16", device="cuda")
    print(f"\nQwen2.5-7B shape, {layers} of 28 layers, random weights, {samples}x{max_tokens} calibration tokens, "
          f"{torch.cuda.get_device_name()}\n"
          f"| method | s ({layers} layers) | s per layer | 28 layers (extrapolated) | peak GB |"
          "\n|---|---|---|---|---|")
    for method in methods:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model, _ = load_policy(dataclasses.replace(spec, method=method))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"| {method} | {dt:.1f} | {dt / layers:.2f} | {dt / layers * 28:.0f} | "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |", flush=True)
        del model
        torch.cuda.empty_cache()


def completions_file(directory: Path, row: str) -> Path:
    """DIR/ROW.jsonl with the row's characters that a file name should not hold ('/', '#', '@', '|', ':', '*')
    replaced: 'nvfp4-awq@/tmp/train.jsonl#last:2' -> 'nvfp4-awq_train.jsonl_last_2.jsonl'."""
    spec, at, source = row.partition("@")
    if at:  # a calibration file's directory says nothing of the row
        source, hash_, keep = source.partition("#")
        row = f"{spec}@{Path(source).name}{hash_}{keep}"
    return directory / (re.sub(r"[/#@|:*~]+", "_", row) + ".jsonl")


def write_completions(directory: Path, row: str, per_problem: list[dict]) -> Path:
    """Write one row's per-problem records (`evaluate`'s per_problem) where `completions_file` names them."""
    directory.mkdir(parents=True, exist_ok=True)
    path = completions_file(directory, row)
    with open(path, "w") as f:
        for p in per_problem:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="bf16,nf4,mxfp4,nvfp4,nvfp4-4over6,nvfp4-gptq,nvfp4-awq")
    ap.add_argument("--test", default="reasoning-gym:basic_arithmetic", help="held-out problems for pass@1")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of pass@1 (0: greedy)")
    ap.add_argument("--batch-size", type=int, default=64, help="sequences per engine call in pass@1")
    ap.add_argument("--short", type=int, default=16, help="a completion this many tokens or fewer counts as short")
    ap.add_argument("--calibration", default="auto")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--no-eval", action="store_true", help="skip pass@1 (KL and time only)")
    ap.add_argument("--out", help="write every number as JSON here")
    ap.add_argument("--keep-completions", metavar="DIR",
                    help="write each row's completions to DIR/ROW.jsonl, one problem a line as `qerl eval --out` "
                         "does (question, answer, completions, rewards, strict, lengths), for completion_forms.py")
    ap.add_argument("--time-7b", type=int, metavar="LAYERS",
                    help="GPU: instead, time quantizing LAYERS decoder layers of a Qwen2.5-7B-shaped model per method")
    args = ap.parse_args(argv)
    if args.keep_completions:  # two rows may not share a file (calibration files of one name in two directories)
        names = [completions_file(Path(args.keep_completions), row).name for row in args.rows.split(",")]
        if len(set(names)) < len(names):
            ap.error(f"--keep-completions: rows {args.rows!r} would share file names {sorted(names)}")
    if args.time_7b:
        from qerl.quant import METHODS
        time_qwen7b(args.time_7b, [r for r in args.rows.split(",") if r in METHODS],
                    args.samples, args.max_tokens)
        return 0

    from qerl.data import load_problems
    from qerl.eval.evaluate import evaluate
    from qerl.eval.fidelity import compare_logprobs, fidelity_text, next_token_logprobs
    from qerl.models import load_causal_lm
    from qerl.rollout.sampling import SamplingParams

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bf16" if device.type == "cuda" else "fp32"
    base, tok = load_causal_lm(args.model, dtype=dtype, device=device)
    ids = tok(fidelity_text(), return_tensors="pt").input_ids.to(device)
    ref = next_token_logprobs(base, ids)
    rows = None if args.no_eval else load_problems(args.test, split="test", limit=args.limit, seed=0)
    cal_cfg = {"source": args.calibration, "samples": args.samples, "max_tokens": args.max_tokens}
    results = []
    for row in args.rows.split(","):
        model, seconds, info = quantize_row(base, tok, row, cal_cfg, device)
        fid = compare_logprobs(ref, next_token_logprobs(model, ids), ids)
        rel_err = None if info.get("awq_scales") else weight_error(base, model)
        res = {"row": row, "seconds": seconds, "weight_rel_err": rel_err,
               **fid, **{k: v for k, v in info.items() if k != "awq_scales"}}
        if rows is not None:
            t_eval = time.perf_counter()
            ev = evaluate(model, tok, rows, n_samples=args.n,
                          sampling=SamplingParams(args.temperature, 0, 0.95 if args.temperature else 1.0),
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=0, progress=False)
            res["eval_s"] = time.perf_counter() - t_eval
            lengths = [n for p in ev["per_problem"] for n in p["lengths"]]
            res.update({"pass1": ev["pass@1"], "mean_length": sum(lengths) / len(lengths),
                        "short_share": sum(n <= args.short for n in lengths) / len(lengths),
                        "truncated": ev["truncated"]})
            if args.keep_completions:
                res["completions"] = str(write_completions(Path(args.keep_completions), row, ev["per_problem"]))
        results.append(res)
        print(json.dumps(res), flush=True)
        if args.out:  # after every row: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "device": str(device), "results": results}, f, indent=1)
        del model
    head = "| row | time s | weight rel err | KL | top-1 agree | ppl | pass@1 | short share | mean len |"
    print(f"\n{args.model} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, "
          f"{time.strftime('%Y-%m-%d')}, {torch.get_num_threads()} threads\n" + head + "\n" + "|---" * 9 + "|")
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for r in results:
        print(f"| {r['row']} | {r['seconds']:.1f} | {fmt(r['weight_rel_err'], '.4f')} | {r['kl']:.4f} | "
              f"{r['top1_agreement']:.3f} | {r['ppl_quant']:.2f} | {fmt(r.get('pass1'), '.3f')} | "
              f"{fmt(r.get('short_share'), '.3f')} | {fmt(r.get('mean_length'), '.1f')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
