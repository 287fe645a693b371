"""End-to-end RL step: rollout -> reference / old log-probs -> loss + backward -> optimizer, on random-weight
Qwen2.5-7B/14B/32B/72B-shaped models, for bf16 LoRA, NF4 LoRA and NVFP4 LoRA (+AQN).

A step is what `qerl train` does per step, with forced lengths (EOS ignored) and random 0/1 rewards:
`prompts` x `group` completions of exactly `--completion` tokens after `--prompt`-token prompts, then one
policy update (GRPO, KL to the LoRA-disabled reference when --kl-beta > 0, gradient checkpointing,
micro-batches of --micro-batch sequences), then AdamW. Reported per cell: seconds per phase, step seconds,
speedup vs bf16 LoRA at the same model and batch, peak GPU memory; "OOM" when it does not fit.
`--memory-cap-gib 78` limits this process's GPU memory (the usable memory of an 80 GB H100) to test fit.

Order (`--order`). Which variant runs first changes its times (a process's first loss pass ran up to 40% slower
than later ones), so by default every variant of a model is built once and the timed steps alternate in
counterbalanced rounds: for variants A, B the rounds run A B, B A, A B, B A, ... (each rotation of the variant
list once per repetition, `--steps` repetitions). Each cell reports the median over all its steps and, per
rotation, the median of the steps in that rotation, so the speedup vs bf16 can be read in every order. Peak
memory excludes what the other resident variants hold (their weights, LoRA, optimizer state).
`--order sequential` builds and times one variant at a time (for models whose variants do not fit together).

The model is built layer by layer on the GPU (meta device, then one decoder layer materialised, randomly
initialised and quantized at a time), so a 72B NVFP4 model never exists in bf16. Speed does not depend on
weight values.

Data parallel: under `torchrun --nproc-per-node N` every rank runs 1/N of the prompts and the LoRA
gradients are all-reduced (the trainer's code path); --check-dist additionally checks that the all-reduced
gradient of a fixed batch equals the single-process gradient of the whole batch.

    python benchmarks/e2e.py --models 7b --variants bf16,nvfp4 --prompts 8 --completion 512 --out e2e.json
    python benchmarks/e2e.py --models 72b --variants nvfp4 --prompts 8 --order sequential --micro-batch 4
    torchrun --nproc-per-node 2 benchmarks/e2e.py --models 7b --variants nvfp4 --prompts 8 --check-dist
"""

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import time

import torch

from ..formats import FORMATS
from .rollout import QWEN25, qwen25_config


def model_config(size: str, layers: int | None = None):
    if size not in QWEN25:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(QWEN25)}")
    return qwen25_config(size, layers)


@torch.no_grad()
def _init_(module: torch.nn.Module, generator: torch.Generator) -> None:
    """HF-like random init in place: biases 0, other vectors (norm weights) 1, matrices N(0, 0.02)."""
    for name, p in module.named_parameters():
        if p.ndim == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            p.normal_(0.0, 0.02, generator=generator)


def build_random_policy(config, fmt: str, lora_r: int, device: torch.device, seed: int = 0):
    """A random-weight causal LM whose decoder linears are QuantLinear(fmt) + LoRA r (fmt "bf16" = the
    16-bit LoRA baseline through the same layer), built one decoder layer at a time on `device`."""
    from ..models.stream import build_layer_by_layer
    from ..nn import LoraConfig

    torch.manual_seed(seed)  # LoRA A is drawn from the default generators: identical on every rank
    g = torch.Generator(device).manual_seed(seed)

    def fill(module, prefix):
        module.to_empty(device=device)
        _init_(module, g)

    model = build_layer_by_layer(config, fmt, LoraConfig(r=lora_r, alpha=2 * lora_r), fill, dtype=torch.bfloat16,
                                 device=device)
    with torch.no_grad():  # a trained-looking adapter (B = 0 would be as fast, but be honest)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3, generator=g)
    model.config.use_cache = False
    return model.eval()


class StepRunner:
    """One model + engine + optimizer; `step()` runs one timed RL step on this rank's share of prompts."""

    def __init__(self, model, args, dist_ctx, sigma: float):
        from ..models.policy import enable_gradient_checkpointing
        from ..rl.losses import LossSettings
        from ..rl.update import UpdateSettings
        from ..rollout.engine import RolloutEngine

        self.model, self.args, self.dist, self.sigma = model, args, dist_ctx, sigma
        enable_gradient_checkpointing(model)
        self.engine = RolloutEngine(model, max_seq_len=args.prompt + args.completion)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-6)
        # the trainer's defaults: one GRPO update, TIS cap 2
        self.settings = UpdateSettings(LossSettings("grpo", 0.2, 0.2, args.kl_beta, args.completion),
                                       micro_batch_size=args.micro_batch)
        self.generator = torch.Generator(model.device).manual_seed(1 + dist_ctx.rank)

    def resident_bytes(self) -> int:
        """Bytes this runner holds between steps (on its device): weights, buffers, LoRA gradients, optimizer
        state."""
        tensors = [*self.model.parameters(), *self.model.buffers(),
                   *(p.grad for p in self.params if p.grad is not None),
                   *(t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def step(self, prompts: int, completion: int, others_bytes: int = 0) -> dict:
        """prompts: this rank's number of prompts; others_bytes: GPU memory held by other resident runners
        (subtracted from the peak). Returns seconds per phase and peak memory (GB)."""
        from ..nn.noisy_norm import NoisyNorms
        from ..rl.advantages import group_advantages
        from ..rl.collect import Experience
        from ..rl.update import policy_update
        from ..rollout.sampling import SamplingParams

        args, G = self.args, self.args.group
        vocab = self.model.config.vocab_size
        ids = torch.randint(0, vocab - 1000, (prompts, args.prompt), generator=torch.Generator().manual_seed(prompts))
        rows = ids.repeat_interleave(G, 0)
        on_gpu = self.model.device.type == "cuda"
        sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        times = {}
        start = time.perf_counter()
        aqn = NoisyNorms(self.model, self.sigma, generator=self.generator) if self.sigma > 0 else None
        r = self.engine.generate(rows, completion, SamplingParams(temperature=1.0), ignore_eos=True,
                                 generator=self.generator, aqn=aqn)
        self.engine.release_memory()  # as the trainer does (rollout.release_kv_cache)
        sync()
        times["rollout"] = time.perf_counter() - start
        rewards = torch.randint(0, 2, (len(rows),), generator=self.generator, device=self.model.device).float()
        lengths = r.completion_mask.sum(1)
        exp = Experience(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.logprobs, r.entropies,
                         rewards, group_advantages(rewards, G), lengths, torch.zeros_like(lengths, dtype=torch.bool))
        policy_update(self.model, exp, self.optimizer, self.params, self.settings, dist_ctx=self.dist, timings=times)
        sync()
        times["step"] = time.perf_counter() - start
        times["peak_gb"] = (torch.cuda.max_memory_allocated() - others_bytes) / 1e9 if on_gpu else 0.0
        times["tokens"] = int(lengths.sum()) * self.dist.world
        return times


def check_distributed(runner: StepRunner, prompts: int) -> tuple[float, float]:
    """(error, noise floor) for a fixed global batch. error = ||g_dist - g_one|| / ||g_one||: the all-reduced
    gradient over the ranks' shares against the single-process gradient of the whole batch (computed on
    every rank; rank 0's is reported). noise floor = the same distance between two single-process
    gradients of the whole batch that differ only in micro-batch size: what bf16 rounding alone moves."""
    from ..rl.advantages import group_advantages
    from ..rl.collect import Experience
    from ..rl.distributed import DistContext, all_reduce_sum
    from ..rl.update import policy_update

    args, G, world, rank = runner.args, runner.args.group, runner.dist.world, runner.dist.rank
    g = torch.Generator().manual_seed(1234)
    n, T, dev, vocab = prompts * G, args.completion, runner.model.device, runner.model.config.vocab_size
    lengths = torch.randint(T // 2, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    full = Experience(torch.randint(0, vocab, (n, args.prompt), generator=g), torch.ones(n, args.prompt, dtype=torch.bool),
                      torch.randint(0, vocab, (n, T), generator=g), mask, torch.zeros(n, T), torch.zeros(n, T),
                      rewards, group_advantages(rewards, G), lengths, torch.zeros(n, dtype=torch.bool))
    full = Experience(*(getattr(full, f).to(dev) for f in Experience.__dataclass_fields__ if f not in ("texts", "stats")))

    def grads(exp, ctx, micro=args.micro_batch):
        sgd = torch.optim.SGD(runner.params, lr=0.0)  # lr 0: the weights stay, the gradient stays in .grad
        settings = dataclasses.replace(runner.settings, micro_batch_size=micro, max_grad_norm=1e9)  # no clipping
        policy_update(runner.model, exp, sgd, runner.params, settings, dist_ctx=ctx)
        return torch.cat([p.grad.flatten().float() for p in runner.params])

    flat = torch.cat([p.detach().flatten().float() for p in runner.params])
    mean = all_reduce_sum(flat.clone(), runner.dist) / world
    if not torch.equal(mean, flat):  # the check compares one policy's gradients, not several
        raise RuntimeError("ranks hold different LoRA weights; the gradient check needs identical policies")
    one = grads(full, DistContext())
    share = torch.arange(n, device=dev).view(prompts, G)[rank::world].flatten()  # whole groups per rank
    mine = Experience(*(getattr(full, f)[share] for f in Experience.__dataclass_fields__ if f not in ("texts", "stats")))
    both = grads(mine, runner.dist)
    reshuffled = grads(full, DistContext(), micro=max(1, args.micro_batch // 2))

    def rel(a):
        return float((a - one).norm() / one.norm().clamp(min=1e-30))

    return rel(both), rel(reshuffled)


def _variant(v: str) -> tuple[str, bool]:
    fmt, _, flag = v.partition("+")
    if fmt not in FORMATS or flag not in ("", "aqn"):
        raise ValueError(f"unknown variant {v!r}: FORMAT[+aqn], FORMAT in {', '.join(FORMATS)}")
    return fmt, flag == "aqn"


def free_gpu():
    gc.collect()
    torch.cuda.empty_cache()


def _median(values):
    """The median; for an even count the upper of the two middle values (a value that was measured)."""
    return statistics.median_high(values)


def _build(config, variant: str, args, dist_ctx, device, size: str) -> tuple[dict, "StepRunner | None"]:
    """(cell, runner) for one variant; runner None and cell["error"] set when the model does not fit."""
    fmt, aqn = _variant(variant)
    cell = dict(model=size, variant=variant, world=dist_ctx.world)
    try:
        t = time.perf_counter()
        model = build_random_policy(config, fmt, args.lora_r, device)
        cell["build_s"] = time.perf_counter() - t
        cell["weights_gb"] = sum(x.numel() * x.element_size() for x in [*model.parameters(), *model.buffers()]) / 1e9
        return cell, StepRunner(model, args, dist_ctx, sigma=args.sigma if aqn else 0.0)
    except torch.OutOfMemoryError:
        hint = " (try --order sequential)" if args.order == "interleaved" and len(args.variants) > 1 else ""
        cell["error"] = "OOM (model)" + hint
        model = None
        free_gpu()
        return cell, None


def _oom(runner: "StepRunner", row: dict) -> None:
    row["error"] = "OOM"
    runner.optimizer.zero_grad(set_to_none=True)
    runner.engine.release_memory()
    free_gpu()


def time_cells(runners: dict, cells: dict, prompts: int, args, dist_ctx) -> list[dict]:
    """One row per variant for `prompts` prompts: an untimed warm-up step each, then `args.steps` repetitions of
    counterbalanced rounds (every rotation of the variant order once). Row values are medians over all timed
    steps; row["orders"] lists the rotations, row["step_by_order"] the median step seconds in each and
    row["step_samples"] every timed step as [rotation, seconds]."""
    rows = {v: {**cells[v], "prompts": prompts, "sequences": prompts * args.group} for v in runners}
    if prompts % dist_ctx.world:
        for row in rows.values():
            row["error"] = f"prompts not a multiple of {dist_ctx.world} ranks"
        return list(rows.values())
    mine = prompts // dist_ctx.world
    alive = []
    for v, runner in runners.items():
        try:
            runner.step(mine, min(args.warmup_completion, args.completion))  # compile, capture, autotune
            alive.append(v)
        except torch.OutOfMemoryError:
            _oom(runner, rows[v])
    resident = {v: runners[v].resident_bytes() for v in alive}
    orders = [alive[o:] + alive[:o] for o in range(len(alive))]
    samples = {v: [] for v in alive}
    for _ in range(args.steps):
        for o, order in enumerate(orders):
            for v in order:
                if "error" in rows[v]:
                    continue
                others = sum(b for u, b in resident.items() if u != v)
                try:
                    samples[v].append((o, runners[v].step(mine, args.completion, others_bytes=others)))
                except torch.OutOfMemoryError:
                    _oom(runners[v], rows[v])
    for v in alive:
        if "error" in rows[v] or not samples[v]:
            continue
        steps = [t for _, t in samples[v]]
        rows[v].update({k: _median([s[k] for s in steps]) for k in steps[0]})
        rows[v]["steps_timed"] = len(steps)
        rows[v]["step_samples"] = [[o, t["step"]] for o, t in samples[v]]  # (rotation, seconds) in run order
        rows[v]["orders"] = [",".join(order) for order in orders]
        in_order = [[t["step"] for o2, t in samples[v] if o2 == o] for o in range(len(orders))]
        rows[v]["step_by_order"] = [_median(s) if s else None for s in in_order]
    if args.check_dist and dist_ctx.world > 1:
        for v in alive:
            if "error" not in rows[v]:
                rows[v]["dist_grad_rel_err"], rows[v]["dist_grad_noise_floor"] = check_distributed(runners[v], prompts)
    return list(rows.values())


def run(args, dist_ctx) -> list[dict]:
    results = []
    device = torch.device("cuda", dist_ctx.local_rank)
    for size in args.models:
        config = model_config(size, args.layers)
        groups = [[v] for v in args.variants] if args.order == "sequential" else [list(args.variants)]
        for group in groups:
            runners, cells = {}, {}
            for variant in group:
                cell, runner = _build(config, variant, args, dist_ctx, device, size)
                if runner is None:
                    results.append(cell)
                    _report(results, args, dist_ctx)
                else:
                    runners[variant], cells[variant] = runner, cell
            for prompts in args.prompts if runners else []:
                for row in time_cells(runners, cells, prompts, args, dist_ctx):
                    results.append(row)
                    _report(results, args, dist_ctx)
            runners = runner = None  # drop the last references before the next group is built
            free_gpu()
    return results


def _report(results, args, dist_ctx):
    """Print the newest cell and rewrite --out with every cell so far (a run cut short keeps its cells)."""
    if not dist_ctx.is_main:
        return
    print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), date=str(datetime.date.today()),
                           torch=torch.__version__, args=vars(args), results=results), f, indent=1)


PHASES = ("rollout", "reference", "loss_backward", "optimizer", "step")


def _by_order(r: dict, base: dict | None) -> str:
    """Speedup vs bf16 per rotation ("2.01x / 1.95x"), from steps timed in the same rounds as bf16's."""
    if (not base or r.get("orders") != base.get("orders") or "step_by_order" not in r
            or None in r["step_by_order"] or None in base["step_by_order"]):
        return "-"
    return " / ".join(f"{b / t:.2f}x" for b, t in zip(base["step_by_order"], r["step_by_order"]))


def table(results, device, args) -> str:
    base = {(r["model"], r["prompts"]): r for r in results if r.get("variant") == "bf16" and "step" in r}
    orders = next((r["orders"] for r in results if "orders" in r and len(r["orders"]) > 1), None)
    lines = [f"device: {device}; {datetime.date.today()}; prompt {args.prompt}, completion {args.completion}, "
             f"G {args.group}, LoRA r {args.lora_r}, micro-batch {args.micro_batch}, KL beta {args.kl_beta}, "
             f"GPUs {results[0]['world'] if results else 1}, order {args.order}, {args.steps} step(s) per rotation"
             + (f", memory cap {args.memory_cap_gib} GiB" if args.memory_cap_gib else ""),
             "| model | variant | prompts x G | rollout s | reference s | loss+backward s | optimizer s | step s "
             "| vs bf16 | vs bf16 by order | tokens/s | peak GB | weights GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        head = f"| {r['model']} | {r['variant']} | {r.get('prompts', '-')} x {args.group} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | | | | {r.get('weights_gb', 0):.1f} |")
            continue
        b = base.get((r["model"], r["prompts"]))
        speed = f"{b['step'] / r['step']:.2f}x" if b else "-"
        lines.append(f"{head} {r['rollout']:.2f} | {r.get('reference', 0):.2f} | {r['loss_backward']:.2f} | "
                     f"{r['optimizer']:.3f} | {r['step']:.2f} | {speed} | {_by_order(r, b)} | "
                     f"{r['tokens'] / r['step']:.0f} | {r['peak_gb']:.1f} | {r['weights_gb']:.1f} |")
    if orders:
        lines.append("\norders (rounds alternate between them): " + "; ".join(f"{i + 1}: {o}" for i, o in enumerate(orders)))
    if any("dist_grad_rel_err" in r for r in results):
        errs = [r["dist_grad_rel_err"] for r in results if "dist_grad_rel_err" in r]
        floor = [r["dist_grad_noise_floor"] for r in results if "dist_grad_noise_floor" in r]
        lines.append(f"\ndata-parallel gradient vs single process (relative L2 error): max {max(errs):.2e}"
                     + (f"; single process, micro-batch halved: max {max(floor):.2e}" if floor else ""))
    return "\n".join(lines)


def ceiling_table(results, device, args) -> str:
    """`step_ceiling`'s bound for every (model, prompts) cell with both bf16 and nvfp4 rows, or "" if none."""
    from .step_ceiling import cells, table as bound_table

    report = dict(device=device, date=str(datetime.date.today()), args=vars(args), results=results)
    try:
        if not cells(report):
            return ""
        return ("ceiling of the NVFP4 step for 4-bit-weight kernels (python benchmarks/step_ceiling.py --help):\n"
                + bound_table([("this run", report)]))
    except ValueError as e:  # the measurements above stand; only the bound is not computable
        return f"no ceiling for this run: {e}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b", help=f"comma list of {','.join(QWEN25)}")
    ap.add_argument("--variants", default="bf16,nf4,nvfp4,nvfp4+aqn", help="FORMAT[+aqn], FORMAT in bf16,nf4,nvfp4,mxfp4")
    ap.add_argument("--prompts", default="2,4,8", help="prompts per step (global, over all ranks)")
    ap.add_argument("--group", type=int, default=8, help="G completions per prompt")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=2048, help="forced completion length (the paper: 2048)")
    ap.add_argument("--warmup-completion", type=int, default=32, help="completion length of the untimed warm-up step")
    ap.add_argument("--steps", type=int, default=3,
                    help="timed steps per variant and order (interleaved: repetitions of the counterbalanced "
                         "rounds; sequential: timed steps); medians reported (the upper middle value for an even "
                         "count: use 3 or more per order)")
    ap.add_argument("--order", choices=("interleaved", "sequential"), default="interleaved",
                    help="interleaved: all variants of a model resident, steps alternate in counterbalanced rounds "
                         "(order-fair); sequential: one variant at a time (less memory)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--kl-beta", type=float, default=0.04, help="0 skips the reference pass")
    ap.add_argument("--sigma", type=float, default=1e-2, help="AQN sigma of +aqn variants")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke tests)")
    ap.add_argument("--memory-cap-gib", type=float, default=None, help="limit this process's GPU memory")
    ap.add_argument("--check-dist", action="store_true", help="under torchrun: check the all-reduced gradient")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    args.variants = args.variants.split(",")
    args.prompts = [int(p) for p in args.prompts.split(",")]
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if len(set(args.variants)) != len(args.variants):
        ap.error(f"--variants lists a variant twice: {','.join(args.variants)}")
    for size in args.models:
        model_config(size, 1)
    for v in args.variants:
        try:
            _variant(v)
        except ValueError as e:
            ap.error(str(e))
    return ap, args


def main(argv=None) -> int:
    from ..rl.distributed import barrier, init_distributed

    ap, args = parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("the step benchmark needs a CUDA GPU")
    dist_ctx = init_distributed(torch.device("cuda"))
    torch.cuda.set_device(dist_ctx.local_rank)
    if args.memory_cap_gib:
        total = torch.cuda.get_device_properties(dist_ctx.local_rank).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total))
    results = run(args, dist_ctx)
    barrier(dist_ctx)
    if dist_ctx.is_main:
        device = torch.cuda.get_device_name()
        print(table(results, device, args))
        bound = ceiling_table(results, device, args)
        if bound:
            print("\n" + bound)
    if dist_ctx.enabled:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
