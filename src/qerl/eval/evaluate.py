"""pass@1 of a model on math problems: sample n completions per problem with the rollout engine, score
them with a reward (math-verify by default), average. Also the `qerl eval` command.

pass@1 = mean over problems of (mean over that problem's n samples of the reward), the unbiased
estimate of single-sample accuracy; with greedy decoding n is forced to 1 (the samples would be equal).
With the default math reward this is the flexible score; the strict one (the answer in the requested
format's last marker) and the shares of completions with no answer / in the requested format come with it
(`qerl.rewards.scores`).
"""

import argparse
import json
import time
from pathlib import Path

import torch

from ..data.datasets import MAX_BAD_FRACTION
from ..argtypes import (checked_by, non_negative_float, non_negative_int, positive_int, probability_mass,
                        unit_interval)
from ..data.templates import GSM8K_SUFFIX, build_prompt, encode_prompt, requested_style, resolve_suffix
from ..formats import FORMATS
from ..kernels.fp8_matmul import check_compute
from ..kernels.route import kernel_policy
from ..models.loader import ModelSpec, load_policy
from ..rewards.math import MathReward, math_reward
from ..rewards.scores import score_all
from ..rollout.engine import RolloutEngine
from ..rollout.sampling import SamplingParams


def _progress(enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[acc]}"),
                    TimeElapsedColumn(), disable=not enabled, transient=False)


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], n_samples: int = 1,
             sampling: SamplingParams = SamplingParams(temperature=0.6, top_p=0.95), max_new_tokens: int = 512,
             batch_size: int = 64, suffix: str | None = GSM8K_SUFFIX, seed: int = 0, reward=math_reward,
             progress: bool = True, system: str | None = None, engine: RolloutEngine | None = None,
             dense_weights: bool = False) -> dict:
    """Sample and score; returns {"pass@1", "n_problems", "n_samples", "mean_length", "truncated", "unscored",
    "per_problem": [{question, answer, completions [n], rewards [n], lengths [n]}]}.

    With the default math reward (a `MathReward` without require_marker) "pass@1" is the flexible score and
    the result also has "pass@1_strict" (the same mean of the strict score: the answer in the last marker of
    the style `suffix` asks for, `requested_style`; any style's marker when it asks for none), "no_answer"
    (share of completions with no extractable answer), "format_followed" (share ending with an answer in the
    requested style, any style when none) and per problem "strict" [n] (1.0 / 0.0 / None like "rewards").
    A custom reward gets none of these keys: what its score means is its own.

    rows: {"question", "answer", ...} (e.g. from `load_problems`); every column is passed to `reward`
    (TRL signature). A reward of None (no reference) counts as 0 and is reported in "unscored".
    batch_size counts sequences (problems x samples) per engine call. engine: reuse one (the trainer's).
    dense_weights (without an engine): decode from 16-bit copies of the 4-bit weights, made once for the call
    (`kernels.dequant_cache`): +2 bytes per weight, much faster for NF4, which has no fused kernel.
    """
    if not rows:
        raise ValueError("evaluate: no problems")
    for name, value in (("n_samples", n_samples), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"evaluate: {name} must be >= 1, got {value}")
    n_samples = 1 if sampling.greedy else n_samples
    prompts = [build_prompt(r["question"], tokenizer, suffix, system) for r in rows]
    ids = [encode_prompt(p, tokenizer) for p in prompts]
    if engine is None:
        engine = RolloutEngine(model, tokenizer, max_seq_len=max(map(len, ids)) + max_new_tokens,
                               dense_weights={} if dense_weights else None)
    jobs = [(i, s) for i in range(len(rows)) for s in range(n_samples)]  # one sequence per (problem, sample)
    texts, lengths, truncated = [None] * len(jobs), [0] * len(jobs), 0
    rewards: list[float | None] = [None] * len(jobs)
    scores = [None] * len(jobs) if isinstance(reward, MathReward) and not reward.require_marker else None
    style = requested_style(suffix)
    columns = {k: [r.get(k) for r in rows] for k in rows[0]}
    with _progress(progress, len(jobs)) as bar:
        task = bar.add_task("eval", total=len(jobs), acc="")
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start:start + batch_size]
            out = engine.generate([ids[i] for i, _ in chunk], max_new_tokens, sampling, seed=seed + start)
            if scores is not None:  # the flexible score is the math reward: parse each completion once
                chunk_scores = score_all(out.texts, [rows[i]["answer"] for i, _ in chunk], style)
                scores[start:start + len(chunk)] = chunk_scores
                scored = [None if sc.flexible is None else float(sc.flexible) for sc in chunk_scores]
            else:
                scored = reward([prompts[i] for i, _ in chunk], out.texts,
                                **{k: [col[i] for i, _ in chunk] for k, col in columns.items()})
            for j, (text, n_tok, why, r) in enumerate(zip(out.texts, out.lengths.tolist(), out.finish_reason, scored)):
                texts[start + j], lengths[start + j], rewards[start + j] = text, n_tok, r
                truncated += why == "length"
            done = [r or 0.0 for r in rewards[:start + len(chunk)]]
            bar.update(task, advance=len(chunk), acc=f"acc {sum(done) / len(done):.3f}")
    per_problem = [{"question": r["question"], "answer": r["answer"], "completions": [], "rewards": [],
                    **({"strict": []} if scores is not None else {}), "lengths": []} for r in rows]
    for j, ((i, _), text, n_tok, r) in enumerate(zip(jobs, texts, lengths, rewards)):
        per_problem[i]["completions"].append(text)
        per_problem[i]["rewards"].append(r)
        per_problem[i]["lengths"].append(n_tok)
        if scores is not None:
            per_problem[i]["strict"].append(None if scores[j].strict is None else float(scores[j].strict))
    means = [sum(r or 0.0 for r in p["rewards"]) / n_samples for p in per_problem]
    result = {"pass@1": sum(means) / len(means)}
    if scores is not None:
        strict = [sum(r or 0.0 for r in p["strict"]) / n_samples for p in per_problem]
        result.update({"pass@1_strict": sum(strict) / len(strict),
                       "no_answer": sum(not sc.extractable for sc in scores) / len(jobs),
                       "format_followed": sum(sc.follows_format for sc in scores) / len(jobs)})
    return {**result, "n_problems": len(rows), "n_samples": n_samples,
            "mean_length": sum(lengths) / len(lengths), "truncated": truncated / len(jobs),
            "unscored": sum(r is None for r in rewards), "per_problem": per_problem}


# ------------------------------------------------------------------------------------------ command


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `qerl eval MODEL --dataset NAME ...`."""
    parser.add_argument("model", help="embedded name, HF / quantized directory, GGUF file or hub id")
    parser.add_argument("--adapter", help="PEFT adapter directory (e.g. a `qerl train` output) to load")
    parser.add_argument("--dataset", required=True,
                        help="gsm8k, gsm8k-offline (GSM8K test; :heldout = its first 500 problems, :train = the 819 "
                             "after them), aime2025, bigmath, reasoning-gym:<task>, or a file")
    parser.add_argument("--split", default="test", help="dataset split (default test)")
    parser.add_argument("--limit", type=positive_int, help="evaluate on the first N problems")
    parser.add_argument("--max-bad-fraction", type=unit_interval, default=MAX_BAD_FRACTION,
                        help="refuse the dataset when more than this share of its rows is malformed (default "
                             f"{MAX_BAD_FRACTION}; 1 = skip them all with a warning)")
    parser.add_argument("--n", type=positive_int, default=4,
                        help="samples per problem (pass@1 averages them; default 4)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.6)
    parser.add_argument("--top-p", type=probability_mass, default=0.95)
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off")
    parser.add_argument("--greedy", action="store_true", help="temperature 0, one sample per problem")
    parser.add_argument("--max-new-tokens", type=positive_int, default=512)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="sequences per engine call")
    parser.add_argument("--suffix", default="gsm8k", type=checked_by(resolve_suffix),
                        help="prompt suffix: gsm8k (####), boxed (\\boxed{}), none, or text:LITERAL TEXT")
    parser.add_argument("--system", help="system message for the chat template")
    parser.add_argument("--format", choices=list(FORMATS),
                        help="quantize the base first (ignored when the model is already quantized)")
    parser.add_argument("--keep-bf16", default="",
                        help="with --format: comma-separated module names / patterns / last:N left in bf16, as the "
                             "trained policy had them (model.keep_bf16; e.g. last:2 for configs/gsm8k-grpo-1.5b.yaml)")
    parser.add_argument("--dtype", default="auto",
                        help="dtype of unquantized tensors: bf16, fp16, fp32, or auto (bf16 on a GPU, fp32 on the CPU)")
    parser.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    parser.add_argument("--dense-weights", action="store_true",
                        help="decode from 16-bit copies of the 4-bit weights (+2 bytes per weight; NF4 has no fused "
                             "kernel and is several times faster so)")
    parser.add_argument("--compute", choices=("bf16", "fp8"), default="bf16",
                        help="products of nvfp4 / mxfp4 weights: fp8 decodes them to e4m3 and rounds the activations "
                             "per token (W4A8), as a policy trained with model.compute fp8 ran (docs/formats.md)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write per-problem results here (JSONL, one problem a line; checked before "
                                      "the model loads, written atomically)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it exists and is a results file qerl eval wrote")
    parser.add_argument("--trust-remote-code", action="store_true")
    return parser


def compute_arg(args) -> None:
    """ValueError when --compute fp8 cannot apply: another --format, 16-bit copies, a GPU without FP8 tensor cores.
    (It acts on the model's nvfp4 / mxfp4 layers: a 16-bit model without --format has none.)"""
    if args.compute == "bf16":
        return
    if args.format not in (None, "nvfp4", "mxfp4"):  # None: a quantized directory as stored
        raise ValueError(f"--compute fp8 multiplies nvfp4 or mxfp4 weights (W4A8), not --format {args.format}")
    if args.dense_weights:
        raise ValueError("--compute fp8 decodes the 4-bit weights to e4m3: not with --dense-weights")
    if args.device != "cpu" and torch.cuda.is_available():
        check_compute(args.compute, torch.device(args.device or "cuda"))


def keep_bf16_arg(args) -> list[str]:
    """--keep-bf16 as a list of patterns, checked: ValueError when malformed or without a 4-bit --format."""
    from ..models.precision import parse_keep_bf16

    keep = parse_keep_bf16(args.keep_bf16)
    if keep and args.format in (None, "bf16"):
        raise ValueError("--keep-bf16 keeps layers of a quantized base in bf16: "
                         "it needs --format nvfp4, mxfp4, nf4 or fp8")
    return keep


def eval_spec(args) -> ModelSpec:
    """`qerl eval`'s arguments as the loader's ModelSpec: the base quantized round-to-nearest while it loads
    when --format names a format; with an adapter and no --format, the 16-bit model ("bf16": the quantized
    layer's 16-bit form, which an adapter attaches to)."""
    return ModelSpec(name=args.model, format=args.format or ("bf16" if args.adapter else None),
                     keep_bf16=tuple(keep_bf16_arg(args)), adapter=args.adapter, dtype=args.dtype,
                     device=args.device or "auto", trust_remote_code=args.trust_remote_code)


def prepare_model(args):
    """Load, quantize when asked, attach the adapter -> (model, tokenizer)."""
    model, tokenizer = load_policy(eval_spec(args))
    if tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer found; evaluation needs one")
    return model, tokenizer


def is_eval_output(path: Path) -> bool:
    """Whether `path` is a per-problem results file `qerl eval --out` wrote (its first line is one problem's
    record), the only kind of file --overwrite replaces."""
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and {"question", "answer", "completions", "rewards"} <= first.keys()


def summary_table(result: dict, title: str):
    from rich.table import Table

    table = Table(title=title, show_header=False)
    strict = "pass@1_strict" in result
    table.add_row("pass@1 (flexible)" if strict else "pass@1", f"{result['pass@1']:.4f}")
    if strict:
        table.add_row("pass@1 strict (answer in the requested format)", f"{result['pass@1_strict']:.4f}")
        table.add_row("no extractable answer", f"{result['no_answer']:.1%}")
        table.add_row("requested format followed", f"{result['format_followed']:.1%}")
    table.add_row("problems x samples", f"{result['n_problems']} x {result['n_samples']}")
    table.add_row("mean completion length", f"{result['mean_length']:.1f} tokens")
    table.add_row("truncated (hit max-new-tokens)", f"{result['truncated']:.1%}")
    if result["unscored"]:
        table.add_row("unscored (no reference answer)", str(result["unscored"]))
    return table


def run_eval(args) -> int:
    """`qerl eval`: evaluate and print a summary; per-problem results to --out. Returns the exit code."""
    from rich.console import Console
    from rich.text import Text

    from ..data import DatasetError, load_problems
    from ..models.adapter import adapter_base_mismatch, check_adapter_files
    from ..models.atomic import atomic_file, check_output_file

    console = Console(stderr=True)
    # everything that can be refused is refused before the dataset and the model load
    keep_bf16_arg(args)
    compute_arg(args)
    inputs = {"--dataset": args.dataset, "model": args.model, "--adapter": args.adapter}
    out = check_output_file(args.out, args.overwrite, recognise=is_eval_output, inputs=inputs) if args.out else None
    mismatch = adapter_base_mismatch(args.adapter, args.model) if args.adapter else None
    if mismatch:
        console.print(Text(f"warning: {mismatch}", style="yellow"), soft_wrap=True)
    if args.adapter:  # a broken or diverged (NaN) adapter is refused before the model loads
        check_adapter_files(args.adapter)
    try:
        rows = load_problems(args.dataset, split=args.split, limit=args.limit, seed=args.seed,
                             max_bad_fraction=args.max_bad_fraction)
    except DatasetError as e:  # the loader names the file, the option is the command's
        raise DatasetError(f"--dataset: {e}") from None
    t0 = time.perf_counter()
    with console.status(f"loading {args.model}"):
        model, tokenizer = prepare_model(args)
    base = f"base {args.format}" + (f" with {args.keep_bf16} in bf16" if args.keep_bf16 else "") if args.format else (
        "base bf16" if args.adapter else "base as stored")
    console.print(f"loaded {args.model} ({base}) in {time.perf_counter() - t0:.1f}s; {len(rows)} problems from "
                  f"{args.dataset}")
    sampling = SamplingParams(0.0) if args.greedy else SamplingParams(args.temperature, args.top_k, args.top_p)
    t0 = time.perf_counter()
    with kernel_policy(compute=args.compute):
        result = evaluate(model, tokenizer, rows, n_samples=args.n, sampling=sampling,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, suffix=args.suffix,
                          seed=args.seed, system=args.system, dense_weights=args.dense_weights)
    seconds = time.perf_counter() - t0
    if out is not None:
        with atomic_file(out) as f:
            for p in result["per_problem"]:
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
    title = f"{args.model}{' + ' + args.adapter if args.adapter else ''} on {args.dataset}"
    console.print(summary_table(result, title))
    summary = {k: v for k, v in result.items() if k != "per_problem"}
    print(json.dumps({**summary, "seconds": round(seconds, 1), "dataset": args.dataset, "model": args.model,
                      "adapter": args.adapter, "out": args.out}))
    return 0
