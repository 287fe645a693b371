"""Rollout throughput: HF `generate` vs the qerl engine (bf16, bf16+LoRA, NVFP4+LoRA, ...) on random-weight
Qwen2.5-shaped models (1.5B to 72B), forced lengths (`--new`) or a completion-length profile (`--lengths`); what
each cell reports and how: docs/cli.md ("qerl bench rollout").

    qerl bench rollout --models 7b --variants bf16+lora,nvfp4+lora --batches 64,128 --lengths long-reasoning-4096
"""

import argparse
import datetime
import json
import statistics
import time

import torch

from ..data.length_profiles import describe, draw, forced_label, lengths_label, resolve_lengths
from ..models.shapes import QWEN25, qwen25_config
from ..models.memory import policy_bytes
from .graph_timing import copy_bandwidth
from .step_ceiling import kv_cache_bytes
from .options import add_lengths_option, add_policy_option, args_json, free_gpu, md_header, or_error, parse_policy

SCHEDULERS = ("continuous", "static")  # the engine's schedulers: continuous (its default) and the static reference


def random_spec(size: str, fmt: str, lora_r: int | None, device, layers: int | None = None,
                embeddings: bool = False):
    """The loader's spec of a random-weight policy (`random:SHAPE`, `qerl.models.random_weights`): decoder linears
    QuantLinear(fmt) + LoRA r (fmt "bf16" = the 16-bit LoRA baseline through the same layer; lora_r None: no
    LoRA), bf16 activations, on `device`; embeddings: the input embedding stored in fmt too."""
    from ..models.loader import ModelSpec
    from ..models.random_weights import random_name
    from ..nn import LoraConfig

    lora = None if lora_r is None else LoraConfig(r=lora_r, alpha=2 * lora_r)
    return ModelSpec(random_name(size, layers), format=fmt, lora=lora, embeddings=embeddings, dtype="bf16",
                     device=device)


def build_model(size: str, layers: int | None, fmt: str | None, lora_r: int, embeddings: bool = False):
    """Random bf16 model on the GPU, frozen, through the loader (`random_spec`); fmt None = plain HF modules (the
    16-bit base as nn.Linear, no LoRA), else qerl QuantLinear(fmt) + LoRA; embeddings: also store the input
    embedding in fmt (`QuantEmbedding`; 4-bit formats only)."""
    from ..models.convert import dequantize_model
    from ..models.loader import load_policy

    model, _ = load_policy(random_spec(size, fmt or "bf16", None if fmt is None else lora_r, "cuda", layers,
                                       embeddings))
    if fmt is None:
        dequantize_model(model, torch.bfloat16)
        model.config.use_cache = True  # HF generate decodes with its KV cache
    model.requires_grad_(False)
    torch.cuda.synchronize()
    return model


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def prompts_tensor(batch: int, length: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab - 1000, (batch, length), generator=g)


def bench_hf(model, batch, args) -> dict:
    ids = prompts_tensor(batch, args.prompt, model.config.vocab_size).cuda()
    mask = torch.ones_like(ids)

    def run(n):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=model.config.pad_token_id)

    run(2)
    torch.cuda.reset_peak_memory_stats()
    short = timed(lambda: run(4))
    long = timed(lambda: run(4 + args.hf_new))
    step = (long - short) / args.hf_new
    prefill = max(short - 4 * step, 0.0)
    return dict(step_ms=1e3 * step, decode_tok_s=batch / step,
                e2e_tok_s=batch * args.new / (prefill + args.new * step),  # extrapolated to --new tokens
                prefill_s=prefill, peak_gb=torch.cuda.max_memory_allocated() / 1e9, new_tokens=args.hf_new)


def bench_engine(engine, batch, args, scheduler: str = "continuous") -> dict:
    from ..rollout.sampling import SamplingParams

    ids = prompts_tensor(batch, args.prompt, engine.model.config.vocab_size)
    sp = SamplingParams(temperature=1.0)
    engine.warmup(batch, args.prompt + args.new)
    engine.generate(ids, 2, sp, seed=0, ignore_eos=True, scheduler=scheduler)
    torch.cuda.reset_peak_memory_stats()
    prefill = timed(lambda: engine.generate(ids, 1, sp, seed=0, ignore_eos=True, scheduler=scheduler))
    total = timed(lambda: engine.generate(ids, args.new, sp, seed=0, ignore_eos=True, scheduler=scheduler))
    step = (total - prefill) / (args.new - 1)
    return dict(step_ms=1e3 * step, decode_tok_s=batch / step, e2e_tok_s=batch * args.new / total,
                prefill_s=prefill, peak_gb=torch.cuda.max_memory_allocated() / 1e9, new_tokens=args.new)


def bench_profile(engine, batch, args, schedulers) -> dict[str, dict]:
    """Per scheduler: the medians over args.repeats rollouts of batch rows (batch / G prompts x G), each row
    forced to a length drawn from args.profile (repeat r: seed args.seed + r, the same for every scheduler;
    the first scheduler alternates). Values: seconds, kept_tok_s, tok_s (decoded row-steps per second),
    rollout_efficiency (row-steps / kept), prefill_tokens, peak_gb."""
    from ..rollout.sampling import SamplingParams

    ids = prompts_tensor(batch // args.group, args.prompt, engine.model.config.vocab_size)
    rows, sp = ids.repeat_interleave(args.group, 0), SamplingParams(temperature=1.0)
    budget = args.profile.max_new_tokens
    engine.warmup(batch, args.prompt + budget)
    for s in schedulers:  # untimed: each scheduler's first call
        engine.generate(rows, budget, sp, seed=0, ignore_eos=True, force_lengths=[2] * batch, scheduler=s)
    runs = {s: [] for s in schedulers}
    for rep in range(args.repeats):
        lengths = draw(args.profile, batch, args.group, args.seed + rep)
        for s in schedulers[rep % len(schedulers):] + schedulers[:rep % len(schedulers)]:
            torch.cuda.reset_peak_memory_stats()
            out = []
            seconds = timed(lambda: out.append(engine.generate(rows, budget, sp, seed=rep, ignore_eos=True,
                                                               force_lengths=lengths, scheduler=s)))
            st = out[0].stats
            kept, decoded = float(st["kept_tokens"]), float(st["decoded_row_steps"])
            runs[s].append(dict(seconds=seconds, kept_tok_s=kept / seconds, tok_s=decoded / seconds,
                                rollout_efficiency=decoded / max(kept, 1.0), prefill_tokens=float(st["prefill_tokens"]),
                                kept_tokens=kept, peak_gb=torch.cuda.max_memory_allocated() / 1e9))
    return {s: {k: statistics.median_high([r[k] for r in rs]) for k in rs[0]} | {"repeats": len(rs)}
            for s, rs in runs.items()}


def run_size(size, args, copy_bw, results):
    from ..rollout.engine import RolloutEngine

    cfg = qwen25_config(size, args.layers)
    for variant in args.variants:
        fmt = None if variant in ("hf", "bf16") else variant.split("+")[0]
        embeddings = args.quantize_embeddings and fmt not in (None, "bf16")
        model = build_model(size, args.layers, fmt, args.lora_r, embeddings)
        read_bytes, total_bytes = policy_bytes(model)
        # +dense: a kept 16-bit copy of every 4-bit weight, read from `dense_min_m` rows (model.dense_weights: all)
        dense = {} if variant.endswith("+dense") and fmt not in (None, "bf16") else None
        engine = None if variant == "hf" else RolloutEngine(model, max_seq_len=args.prompt + args.budget,
                                                           cuda_graphs=not args.eager,
                                                           fused_sampling=not args.eager_sampling, dense_weights=dense)
        for batch in (args.hf_batches if variant == "hf" else args.batches):
            try:  # an engine cell: one row per scheduler
                if variant == "hf":
                    rows = [dict(bench_hf(model, batch, args), scheduler="-")]
                elif args.profile is not None:  # the schedulers alternate on the same draws
                    by_scheduler = bench_profile(engine, batch, args, args.schedulers)
                    rows = [dict(r, scheduler=s) for s, r in by_scheduler.items()]
                else:  # one scheduler after the other
                    rows = [dict(bench_engine(engine, batch, args, s), scheduler=s) for s in args.schedulers]
            except torch.OutOfMemoryError:
                rows = [dict(error="out of memory", scheduler=",".join(args.schedulers))]
                torch.cuda.empty_cache()
            for r in rows:
                if "step_ms" in r:
                    floor_s = (read_bytes + kv_cache_bytes(cfg, batch, args.prompt, args.new)) / copy_bw  # weights + KV
                    r.update(weight_gb_s=read_bytes / (r["step_ms"] / 1e3) / 1e9,
                             floor_frac=floor_s / (r["step_ms"] / 1e3))
                r.update(model=size, variant=variant, batch=batch, policy_gb=total_bytes / 1e9,
                         quantized_embeddings=embeddings, lengths=lengths_label(args.profile, args.new))
                results.append(r)
                print(json.dumps(r), flush=True)
        del engine, model
        free_gpu()


def _variant_name(r: dict) -> str:
    return r["variant"] + ("+qemb" if r.get("quantized_embeddings") else "")  # 4-bit input embedding


def profile_table(results, device, args) -> str:
    """The --lengths table: per (model, variant, batch, scheduler) rollout seconds, kept tokens/s, tokens/s,
    row-steps / kept and the speedup over the static scheduler on the same draws."""
    lines = [f"device: {device}; {datetime.date.today()}; prompt {args.prompt}, G {args.group}, {args.repeats} "
             f"draw(s) per cell (seed {args.seed} + repeat), medians",
             f"lengths: {describe(args.profile)}; rows forced to drawn lengths, max_new_tokens "
             f"{args.profile.max_new_tokens}; source: {args.profile.source}",
             md_header("model | variant | scheduler | batch (prompts x G) | rollout s | kept tok/s | tok/s | row-steps "
                       "/ kept | vs static | peak GB | policy GB")]
    for r in results:
        head = (f"| {r['model']} | {_variant_name(r)} | {r['scheduler']} | {r['batch']} "
                f"({r['batch'] // args.group} x {args.group}) |")
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | |")
            continue
        static = next((b for b in results if "seconds" in b and b["scheduler"] == "static" and b is not r and
                       all(b[k] == r[k] for k in ("model", "variant", "batch", "quantized_embeddings"))), None)
        vs = f"{static['seconds'] / r['seconds']:.2f}x" if static else "-"
        lines.append(f"{head} {r['seconds']:.2f} | {r['kept_tok_s']:.0f} | {r['tok_s']:.0f} | "
                     f"{r['rollout_efficiency']:.2f} | {vs} | {r['peak_gb']:.1f} | {r['policy_gb']:.2f} |")
    lines.append("\nkept tok/s: real completion tokens per rollout second; tok/s: rows decoded per second (a finished "
                 "row still held in the batch counts); row-steps / kept: their ratio (1 = no row decoded past its end)")
    return "\n".join(lines)


def table(results, device, copy_bw, new: int | None = None) -> str:
    """The forced-lengths table (every row exactly `new` tokens)."""
    lines = [f"device: {device}; copy bandwidth {copy_bw / 1e12:.2f} TB/s; {datetime.date.today()}"
             + (f"; lengths: {forced_label(new)}" if new else ""),
             md_header("model | variant | scheduler | batch | e2e tok/s | decode tok/s | ms/step | weight GB/s | % "
                       "floor | peak GB | policy GB")]
    for r in results:
        sched = r.get("scheduler", "-")
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | {sched} | {r['batch']} | {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {_variant_name(r)} | {sched} | {r['batch']} | {r['e2e_tok_s']:.0f} | "
                     f"{r['decode_tok_s']:.0f}"
                     f" | {r['step_ms']:.2f} | {r['weight_gb_s']:.0f} | {100 * r['floor_frac']:.0f}% "
                     f"| {r['peak_gb']:.1f} | {r['policy_gb']:.2f} |")
    return "\n".join(lines)


def parse_schedulers(text: str) -> list[str]:
    """"continuous,static" -> ["continuous", "static"]; raises ValueError for unknown or repeated names."""
    names = text.split(",")
    if any(n not in SCHEDULERS for n in names) or len(set(names)) != len(names):
        raise ValueError(f"--schedulers {text!r}: a comma list of distinct {', '.join(SCHEDULERS)}")
    return names


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b", help=f"comma list of {','.join(QWEN25)} (Qwen2.5 shapes)")
    ap.add_argument("--variants", default="hf,bf16,bf16+lora,nvfp4+lora",
                    help="hf (HF generate), bf16 (engine, plain HF modules), <fmt>+lora, <fmt>+lora+dense")
    ap.add_argument("--batches", default="1,8,32,64,128", help="rows per rollout (--lengths: multiples of --group)")
    ap.add_argument("--hf-batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=None,
                    help="forced lengths: every row exactly this many new tokens (default 512)")
    add_lengths_option(ap)
    ap.add_argument("--group", type=int, default=8, help="--lengths: G rows per prompt")
    ap.add_argument("--seed", type=int, default=0, help="--lengths: repeat r draws with seed + r")
    ap.add_argument("--repeats", type=int, default=3, help="--lengths: timed draws per cell (median reported)")
    ap.add_argument("--schedulers", default="continuous", help="comma list of continuous, static")
    ap.add_argument("--hf-new", type=int, default=24)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--eager-sampling", action="store_true", help="torch ops, not the one-launch Triton sampler")
    ap.add_argument("--quantize-embeddings", action="store_true", help="4-bit <fmt>+lora: the input embedding too")
    ap.add_argument("--disable", default="",
                    help="comma list of kernel backends to route around (qerl.kernels.route names)")
    add_policy_option(ap, "permute_x=false or wgmma_max_m=64): an A/B of a routing rule inside the engine")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)
    from ..kernels.route import BACKENDS

    parse_policy(ap, args)
    args.disable = [b for b in args.disable.split(",") if b]
    unknown = sorted(set(args.disable) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backends {unknown}; known: {', '.join(BACKENDS)}")
    args.variants = args.variants.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",")]
    args.schedulers = or_error(ap, parse_schedulers, args.schedulers)
    # --new >= 2: the decode rate is (all - first token) / (new - 1)
    args.profile, args.new, args.budget = resolve_lengths(ap, args.lengths, args.new, "--new", 512, 2)
    if args.profile is not None:
        if "hf" in args.variants:
            ap.error("--lengths: HF generate cannot force per-row lengths; drop the hf variant")
        if args.group < 1 or args.repeats < 1 or any(b < 1 or b % args.group for b in args.batches):
            ap.error(f"--lengths: --batches must be positive multiples of --group ({args.group}); --repeats >= 1")
    return ap, args


def main(argv=None) -> int:
    from ..kernels.route import kernel_policy

    ap, args = parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("the rollout benchmark needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    results = []
    policy = dict(args.policy)
    disabled = set(args.disable) | set(policy.pop("disabled", ()))
    with kernel_policy(**policy, disabled=disabled):
        for size in args.models.split(","):
            run_size(size, args, bw, results)
    print(table(results, device, bw, args.new) if args.profile is None else profile_table(results, device, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, date=str(datetime.date.today()), copy_bw=bw, torch=torch.__version__,
                           args=args_json(args), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
