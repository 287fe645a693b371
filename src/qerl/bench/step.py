"""End-to-end RL step (`qerl train`'s `qerl.rl.step.rl_step` with random 0/1 rewards) on random-weight
Qwen2.5-7B/14B/32B/72B-shaped models, for bf16 LoRA, NF4 LoRA and NVFP4 LoRA (+AQN). What a step runs, the
lengths, modes, order (`--order`) and every column: docs/cli.md ("qerl bench step").

    qerl bench step --models 7b --variants bf16,nvfp4 --prompts 16 --lengths long-reasoning-4096 --modes new,old
    torchrun --nproc-per-node 2 -m qerl.bench.step --models 7b --variants nvfp4 --prompts 8 --check-dist
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import time

import torch

from ..choices import PACKED_ATTENTION
from ..formats import FORMATS
from ..kernels.route import kernel_policy
from ..rollout.memory import EngineMemoryPolicy
from ..data.length_profiles import describe, draw, forced_label, lengths_label, resolve_lengths
from ..models.shapes import MOE_SHAPES, QWEN25
from ..nn.quant_experts import QuantExperts
from .rollout import parse_schedulers, prompts_tensor, random_spec
from .options import add_lengths_option, add_policy_option, args_json, free_gpu, md_header, or_error, parse_policy
from .update_profile import PhaseBusy, profile_call, profile_table


def model_config(size: str, layers: int | None = None):
    """The random-weight config of a dense Qwen2.5 size or a `MOE_SHAPES` mixture of experts (what
    `rollout.random_spec` loads)."""
    from ..models.random_weights import random_config, random_name

    if size not in QWEN25 and size not in MOE_SHAPES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(QWEN25) + sorted(MOE_SHAPES)}")
    return random_config(random_name(size, layers))


class StepRunner:
    """One model + engine + optimizer; `step()` runs one timed RL step on this rank's share of prompts."""

    def __init__(self, model, args, dist_ctx, sigma: float, dense_weights: str = "off", compute: str = "bf16"):
        from ..models.policy import enable_gradient_checkpointing
        from ..rl.losses import LossSettings
        from ..rl.packing import token_budget
        from ..rl.runtime import build_runtime
        from ..rl.update import UpdateSettings

        self.model, self.args, self.dist, self.sigma = model, args, dist_ctx, sigma
        enable_gradient_checkpointing(model)
        # what the trainer builds around its model: the routing of model.compute, the model.dense_weights store,
        # the engine and its memory policy (--release-kv-cache as rollout.release_kv_cache), the recompute plan
        # (optim.gradient_checkpointing, planned against that memory policy)
        runtime = build_runtime(model, max_seq_len=args.prompt + args.budget, compute=compute,
                                dense_weights=dense_weights, release_kv_cache=RELEASE_SETTINGS[args.release_kv_cache],
                                distributed=dist_ctx.world > 1,
                                gradient_checkpointing=CHECKPOINTING_SETTINGS[args.gradient_checkpointing])
        self.routing, self.dense_store, self.engine = runtime.routing, runtime.dense_store, runtime.engine
        self.engine_memory, self.recompute = runtime.engine_memory, runtime.recompute
        self.release_always = EngineMemoryPolicy(True, model.device)  # the static reference: free after every rollout
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-6)
        # the trainer's defaults: one GRPO update, TIS cap 2; packing is set per cell (`step`)
        tokens = args.max_tokens_per_micro_batch or token_budget(model.config)  # None: qerl train's default
        self.settings = UpdateSettings(LossSettings("grpo", 0.2, 0.2, args.kl_beta, args.budget),
                                       micro_batch_size=args.micro_batch, max_tokens_per_micro_batch=tokens,
                                       packed_attention=args.packed_attention)
        self.generator = torch.Generator(model.device).manual_seed(1 + dist_ctx.rank)

    def resident_bytes(self) -> int:
        """Bytes this runner holds between steps (on its device): weights, buffers, LoRA gradients, optimizer
        state, dense weight copies."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *(w for _, w in (self.dense_store or {}).values()),
                   *(p.grad for p in self.params if p.grad is not None),
                   *(t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def step(self, prompts: int, completion: int, others_bytes: int = 0, lengths: list[int] | None = None,
             mode: tuple[str, bool] = ("continuous", True), profile_update: bool = False, busy: bool = False) -> dict:
        """One step on this rank's `prompts` prompts x G rows; the row of the table (docs/cli.md, "qerl bench step").

        completion: every row's forced length when `lengths` is None; lengths: this rank's per-row forced lengths
        (prompts x G ints, a prompt's rows adjacent; max_new_tokens is then args.budget); mode: (engine scheduler,
        packed update); others_bytes: GPU memory of the other resident runners (taken off the peak); profile_update
        / busy: add "update_profile" / "busy" (`bench.update_profile`; the phase times are then not comparable)."""
        from ..nn.noisy_norm import NoisyNorms
        from ..rl.advantages import group_advantages
        from ..rl.collect import Experience
        from ..rl.distributed import all_reduce_sum
        from ..rl.step import rl_step
        from ..rollout.sampling import SamplingParams

        args, G = self.args, self.args.group
        scheduler, packing = mode
        rows = prompts_tensor(prompts, args.prompt, self.model.config.vocab_size).repeat_interleave(G, 0)
        limit = completion if lengths is None else args.budget  # max_new_tokens; a row that reaches it is at budget
        if lengths is not None and len(lengths) != len(rows):
            raise ValueError(f"{len(lengths)} forced lengths for {len(rows)} rows")

        def collect() -> Experience:  # the rollout (forced lengths, EOS ignored) with random 0/1 rewards
            aqn = NoisyNorms(self.model, self.sigma, generator=self.generator) if self.sigma > 0 else None
            # the same engine (and its graphs) serves every mode: the scheduler is chosen per call
            r = self.engine.generate(rows, limit, SamplingParams(temperature=1.0), ignore_eos=True,
                                     force_lengths=lengths, generator=self.generator, aqn=aqn, scheduler=scheduler)
            rewards = torch.randint(0, 2, (len(rows),), generator=self.generator, device=self.model.device).float()
            got = r.completion_mask.sum(1)
            at_budget = got >= limit
            work = {f"rollout_{k}": float(r.stats[k]) for k in ("decoded_row_steps", "prefill_tokens")}
            return Experience(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.logprobs,
                              r.entropies, rewards, group_advantages(rewards, G), got, at_budget, stats=work)

        times = {}

        def profiled(update):
            stats, times["update_profile"] = profile_call(update, self.model.device)
            return stats

        phases = PhaseBusy(self.model.device) if busy else None
        on_gpu = self.model.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        # the static, padded reference frees the engine's memory after every rollout; the other modes follow
        # --release-kv-cache as qerl train follows rollout.release_kv_cache (after a reference cell the graphs are
        # gone anyway)
        engine_kept = mode != OLD_MODE and self.engine_memory.keep  # as this step runs (its after_update may flip it)
        with contextlib.nullcontext() if self.routing is None else kernel_policy(self.routing):
            step = rl_step(collect, model=self.model, engine=self.engine,
                           memory=self.release_always if mode == OLD_MODE else self.engine_memory,
                           optimizer=self.optimizer, params=self.params,
                           settings=dataclasses.replace(self.settings, packing=packing), dist_ctx=self.dist,
                           dense_store=self.dense_store, synchronize=True, times=times,
                           run_update=profiled if profile_update else None, phase=phases, recompute=self.recompute)
        if step.non_finite is not None:
            raise step.non_finite
        exp, stats = step.experience, step.update
        times["peak_gb"] = (torch.cuda.max_memory_allocated() - others_bytes) / 1e9 if on_gpu else 0.0
        counts = torch.tensor([float(x) for x in (exp.lengths.sum(), exp.stats["rollout_decoded_row_steps"],
                                                  exp.stats["rollout_prefill_tokens"], stats["loss_tokens_computed"],
                                                  stats["loss_tokens_needed"], stats.get("update_flops", -1.0))],
                              dtype=torch.float64, device=self.dist.device)
        kept, decoded, prefill, computed, needed, flops = all_reduce_sum(counts, self.dist).tolist()  # per rank -> step
        times.update(tokens=int(kept), decoded_row_steps=int(decoded), prefill_tokens=int(prefill),
                     loss_tokens_computed=int(computed), loss_tokens_needed=int(needed),
                     kept_tok_s=kept / times["step"], rollout_efficiency=decoded / max(kept, 1.0),
                     loss_efficiency=computed / max(needed, 1.0),
                     recomputed_layers=stats.get("recomputed_layers", -1.0),
                     checkpointable_layers=len(self.recompute.layers), engine_kept=engine_kept)
        if self.recompute.saved is not None:  # auto's probe: bytes a decoder layer keeps per token
            times.update(saved_bytes_plain=self.recompute.saved.plain,
                         saved_bytes_checkpointed=self.recompute.saved.checkpointed,
                         recompute_fallbacks=self.recompute.fallbacks)
        if "update_flops" in stats:  # every rank counts the same model
            update_s = max(times["step"] - times["rollout"], 1e-9)
            times.update(update_flops=flops, update_tflops=flops / self.dist.world / update_s / 1e12)
        if phases is not None:
            times["busy"] = phases.shares()
        return times


def check_distributed(runner: StepRunner, prompts: int) -> tuple[float, float]:
    """`qerl.rl.update.data_parallel_gradient_check` of the runner's policy on a fixed random global batch of
    `prompts` x G rows: (error, noise floor)."""
    from ..rl.advantages import group_advantages
    from ..rl.collect import Experience
    from ..rl.update import data_parallel_gradient_check

    args, G = runner.args, runner.args.group
    g = torch.Generator().manual_seed(1234)
    n, T, vocab = prompts * G, args.budget, runner.model.config.vocab_size
    lengths = torch.randint(T // 2, T + 1, (n,), generator=g)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    batch = Experience(torch.randint(0, vocab, (n, args.prompt), generator=g),
                       torch.ones(n, args.prompt, dtype=torch.bool), torch.randint(0, vocab, (n, T), generator=g),
                       torch.arange(T)[None] < lengths[:, None], torch.zeros(n, T), torch.zeros(n, T), rewards,
                       group_advantages(rewards, G), lengths, torch.zeros(n, dtype=torch.bool))
    return data_parallel_gradient_check(runner.model, runner.params, runner.settings, batch, G, runner.dist)


DENSE_FLAGS = {"dense": "update", "denseall": "all"}  # variant flag -> model.dense_weights


def _variant(v: str) -> tuple[str, bool, str, str]:
    """FORMAT[+aqn][+dense|+denseall][+w4a8] -> (format, AQN on, model.dense_weights, model.compute)."""
    fmt, *flags = v.split("+")
    dense = [DENSE_FLAGS[f] for f in flags if f in DENSE_FLAGS]
    w4a8 = "w4a8" in flags
    if (fmt not in FORMATS or any(f not in ("aqn", "w4a8", *DENSE_FLAGS) for f in flags)
            or len(set(flags)) != len(flags) or len(dense) > 1 or (dense and fmt == "bf16")
            or (w4a8 and (fmt not in ("nvfp4", "mxfp4") or dense))):
        raise ValueError(f"unknown variant {v!r}: FORMAT[+aqn][+dense|+denseall][+w4a8], FORMAT in "
                         f"{', '.join(FORMATS)} (+dense: 16-bit weight copies for the loss pass, +denseall: also for "
                         "rollouts, 4-bit only; +w4a8: model.compute fp8, nvfp4 / mxfp4 without dense copies)")
    return fmt, "aqn" in flags, dense[0] if dense else "off", "fp8" if w4a8 else "bf16"


def _build(variant: str, args, dist_ctx, device, size: str) -> tuple[dict, "StepRunner | None"]:
    """(cell, runner) for one variant; runner None and cell["error"] set when the model does not fit."""
    from ..models.loader import load_policy

    fmt, aqn, dense, compute = _variant(variant)
    cell = dict(model=size, variant=variant, world=dist_ctx.world)
    try:
        t = time.perf_counter()
        model, _ = load_policy(random_spec(size, fmt, args.lora_r, device, args.layers))
        for m in model.modules() if args.moe_reference else ():
            if isinstance(m, QuantExperts):
                m.grouped_kernel = False
        cell["build_s"] = time.perf_counter() - t
        cell["weights_gb"] = sum(x.numel() * x.element_size() for x in [*model.parameters(), *model.buffers()]) / 1e9
        return cell, StepRunner(model, args, dist_ctx, sigma=args.sigma if aqn else 0.0, dense_weights=dense,
                                compute=compute)
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


OLD_MODE = ("static", False)  # the reference: static batches, padded micro-batches
MODES = {"new": ("continuous", True), "old": OLD_MODE}  # --modes names -> (engine scheduler, packed update)
PACKING = {"on": True, "off": False}
RELEASE_SETTINGS = {"auto": None, "always": True}  # --release-kv-cache -> rollout.release_kv_cache
CHECKPOINTING_SETTINGS = {"auto": "auto", "true": True, "false": False}  # -> optim.gradient_checkpointing


def mode_label(mode: tuple[str, bool]) -> str:
    """("continuous", True) -> "continuous+packed"."""
    return f"{mode[0]}+{'packed' if mode[1] else 'padded'}"


def cell_label(variant: str, mode: tuple[str, bool], args) -> str:
    """How rotations name a cell: the variant alone when the run has one mode."""
    return variant if len(args.modes) == 1 else f"{variant} {mode_label(mode)}"


def rank_lengths(lengths: list[int], group: int, dist_ctx) -> list[int]:
    """This rank's rows of a whole step's lengths: whole groups, every world-th from its rank (as the
    trainer and `check_distributed` split prompts)."""
    groups = [lengths[i:i + group] for i in range(0, len(lengths), group)]
    return [n for g in groups[dist_ctx.rank::dist_ctx.world] for n in g]


def step_lengths(args, prompts: int, repetition: int, dist_ctx) -> list[int] | None:
    """This rank's per-row lengths of one repetition's whole step (`rank_lengths`; None in forced-lengths mode)."""
    if args.profile is None:
        return None
    whole = draw(args.profile, prompts * args.group, args.group, args.seed + repetition)
    return rank_lengths(whole, args.group, dist_ctx)


def time_cells(runners: dict, cells: dict, prompts: int, args, dist_ctx) -> list[dict]:
    """One row per cell (variant x mode of args.modes) for `prompts` prompts: an untimed warm-up step each, then
    `args.steps` repetitions of counterbalanced rounds (every rotation of the cell order once; every cell of a
    repetition gets the same length draw). Row values are medians over all timed steps; row["orders"] lists
    the rotations, row["step_by_order"] the median step seconds in each and row["step_samples"] every timed
    step as [rotation, seconds]."""
    keys = [(v, m) for v in runners for m in args.modes]
    rows = {(v, m): {**cells[v], "scheduler": m[0], "packing": m[1], "mode": mode_label(m),
                     "lengths": lengths_label(args.profile, args.completion), "prompts": prompts,
                     "sequences": prompts * args.group} for v, m in keys}
    if prompts % dist_ctx.world:
        for row in rows.values():
            row["error"] = f"prompts not a multiple of {dist_ctx.world} ranks"
        return list(rows.values())
    mine = prompts // dist_ctx.world
    warm = min(args.warmup_completion, args.budget)
    # a profile's warm-up is a whole draw the timed steps never use (seed - 1): ragged rows compact into every
    # width the timed steps reach, so no decode kernel compiles inside a timed step
    warm_lengths = step_lengths(args, prompts, -1, dist_ctx)
    alive = []
    for v, m in keys:  # compile, capture, autotune: every mode runs its own code
        try:
            started = time.perf_counter()
            runners[v].step(mine, warm if warm_lengths is None else args.budget, lengths=warm_lengths, mode=m)
            rows[(v, m)]["first_step_s"] = time.perf_counter() - started  # compilation and graph capture included
            if m != OLD_MODE and runners[v].engine_memory.keep:  # auto decided to keep the engine's memory:
                # a second step reaches the steady state of a run (the first kept rollout captures again)
                runners[v].step(mine, warm if warm_lengths is None else args.budget, lengths=warm_lengths, mode=m)
            alive.append((v, m))
        except torch.OutOfMemoryError:
            _oom(runners[v], rows[(v, m)])
    resident = {v: runners[v].resident_bytes() for v in dict.fromkeys(v for v, _ in alive)}
    orders = [alive[o:] + alive[:o] for o in range(len(alive))]
    samples = {k: [] for k in alive}
    for rep in range(args.steps):
        lengths = step_lengths(args, prompts, rep, dist_ctx)
        for o, order in enumerate(orders):
            for v, m in order:
                if "error" in rows[(v, m)]:
                    continue
                others = sum(b for u, b in resident.items() if u != v)
                try:
                    samples[(v, m)].append((o, runners[v].step(mine, args.completion, others_bytes=others,
                                                                lengths=lengths, mode=m)))
                except torch.OutOfMemoryError:
                    _oom(runners[v], rows[(v, m)])
    # --busy (each phase under its own profiler session), --profile-update (the update under the profiler): one
    # more step per cell, untimed, so the profiler's own cost stays out of the medians
    profiled = {k: {} for k in alive}
    for flag, key in (("busy", "busy"), ("profile_update", "update_profile")):
        for v, m in alive if getattr(args, flag) else []:
            if "error" not in rows[(v, m)]:
                profiled[(v, m)][key] = runners[v].step(mine, args.completion, mode=m, **{flag: True},
                                                        lengths=step_lengths(args, prompts, 0, dist_ctx))[key]
    for k in alive:
        if "error" in rows[k] or not samples[k]:
            continue
        rows[k].update(profiled[k])
        steps = [t for _, t in samples[k]]
        # medians: for an even count the upper of the two middle values (a value that was measured)
        rows[k].update({name: statistics.median_high([s[name] for s in steps]) for name in steps[0]})
        rows[k]["steps_timed"] = len(steps)
        rows[k]["step_samples"] = [[o, t["step"]] for o, t in samples[k]]  # (rotation, seconds) in run order
        rows[k]["orders"] = [",".join(cell_label(v, m, args) for v, m in order) for order in orders]
        in_order = [[t["step"] for o2, t in samples[k] if o2 == o] for o in range(len(orders))]
        rows[k]["step_by_order"] = [statistics.median_high(s) if s else None for s in in_order]
    firsts = {}  # one check per variant, on its first cell that ran: the gradient does not depend on the mode
    for v, m in alive if args.check_dist and dist_ctx.world > 1 else ():
        if "error" not in rows[(v, m)]:
            firsts.setdefault(v, (v, m))
    for v, k in firsts.items():
        rows[k]["dist_grad_rel_err"], rows[k]["dist_grad_noise_floor"] = check_distributed(runners[v], prompts)
    return list(rows.values())


def run(args, dist_ctx) -> list[dict]:
    results = []
    device = torch.device("cuda", dist_ctx.local_rank)
    for size in args.models:
        groups = [[v] for v in args.variants] if args.order == "sequential" else [list(args.variants)]
        for group in groups:
            runners, cells = {}, {}
            for variant in group:
                cell, runner = _build(variant, args, dist_ctx, device, size)
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
                           torch=torch.__version__, args=args_json(args), results=results), f, indent=1)


def _by_order(r: dict, base: dict | None) -> str:
    """Speedup vs bf16 per rotation ("2.01x / 1.95x"), from steps timed in the same rounds as bf16's."""
    if (not base or r.get("orders") != base.get("orders") or "step_by_order" not in r
            or None in r["step_by_order"] or None in base["step_by_order"]):
        return "-"
    return " / ".join(f"{b / t:.2f}x" for b, t in zip(base["step_by_order"], r["step_by_order"]))


def _timed(results, **match) -> dict | None:
    """The first timed row whose fields equal `match`."""
    return next((r for r in results if "step" in r and all(r.get(k) == v for k, v in match.items())), None)


def _speedup(base: dict | None, r: dict) -> str:
    return f"{base['step'] / r['step']:.2f}x" if base is not None and base is not r else "-"


def _flops_cells(r: dict) -> str:
    """The update TFLOP and update TFLOP/s cells of a timed row ("- | -" for a model qerl.rl.flops does not count)."""
    return "- | -" if r.get("update_flops") is None else f"{r['update_flops'] / 1e12:.1f} | {r['update_tflops']:.0f}"


def _recomputed_cell(r: dict) -> str:
    """'recomputed of layers', or '-' for a row without the count (absent, or a model without checkpointable layers)."""
    if r.get("recomputed_layers", -1) < 0:
        return "-"
    return f"{r['recomputed_layers']:.0f} of {r['checkpointable_layers']:.0f}"


def _busy_cell(r: dict) -> str:
    """The GPU-busy shares of the rollout, reference and loss + backward phases ("-" where not measured)."""
    busy, phases = r.get("busy"), ("rollout", "reference", "loss_backward")
    return " / ".join(f"{busy[p]['share']:.0%}" if p in busy else "-" for p in phases) if busy else "-"


def lengths_line(args) -> str:
    """The table's line on completion lengths."""
    if args.profile is None:
        return f"lengths: {forced_label(args.completion)}: every row exactly {args.completion} tokens, EOS ignored"
    return (f"lengths: {describe(args.profile)}; each repetition draws the groups' lengths (seed {args.seed} + "
            f"repetition), rows forced to them, max_new_tokens {args.budget}; source: {args.profile.source}")


def table(results, device, args) -> str:
    orders = next((r["orders"] for r in results if "orders" in r and len(r["orders"]) > 1), None)
    tokens = args.max_tokens_per_micro_batch or "by model size (token_budget)"
    lines = [f"device: {device}; {datetime.date.today()}; prompt {args.prompt}, G {args.group}, LoRA r {args.lora_r}, "
             f"micro-batch {args.micro_batch} rows (padded) / {tokens} tokens (packed), KL beta {args.kl_beta}, "
             f"gradient checkpointing {args.gradient_checkpointing}, GPUs {results[0]['world'] if results else 1}, "
             f"order {args.order}, {args.steps} step(s) per rotation"
             + (f", memory cap {args.memory_cap_gib} GiB" if args.memory_cap_gib else ""),
             lengths_line(args),
             md_header("model | variant | mode | prompts x G | rollout s | reference s | loss+backward s | optimizer s "
                       "| step s | vs old | vs bf16 | vs bf16 by order | kept tok/s | row-steps / kept | recomputed "
                       "layers | loss tokens computed / needed | peak GB | weights GB | update TFLOP | update TFLOP/s "
                       "| GPU busy rollout / ref / loss")]
    for r in results:
        head = f"| {r['model']} | {r['variant']} | {r.get('mode', '-')} | {r.get('prompts', '-')} x {args.group} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | | | | | | | | {r.get('weights_gb', 0):.1f} | | | |")
            continue
        same = dict(model=r["model"], prompts=r["prompts"])
        b = _timed(results, variant="bf16", mode=r["mode"], **same)
        old = _timed(results, variant=r["variant"], mode=mode_label(OLD_MODE), **same)
        lines.append(f"{head} {r['rollout']:.2f} | {r.get('reference', 0):.2f} | {r['loss_backward']:.2f} | "
                     f"{r['optimizer']:.3f} | {r['step']:.2f} | {_speedup(old, r)} | {_speedup(b, r)} | "
                     f"{_by_order(r, b)} | {r['kept_tok_s']:.0f} | {r['rollout_efficiency']:.2f} | "
                     f"{_recomputed_cell(r)} | "
                     f"{r['loss_efficiency']:.2f} | {r['peak_gb']:.1f} | {r['weights_gb']:.1f} | "
                     f"{_flops_cells(r)} | {_busy_cell(r)} |")
    lines.append("\nvs old: step time of the same variant in mode " + mode_label(OLD_MODE) + " / this one; vs bf16: "
                 "bf16's in the same mode / this one; kept tok/s: real completion tokens per step second; row-steps / "
                 "kept: rows the rollout decoded per kept token (1 = none past its end); recomputed layers: decoder "
                 "layers the backward ran forward again (median over the timed steps); loss tokens computed / "
                 "needed: tokens one forward pass of the update runs through the model per token it needs (each "
                 "group's prompt once + the completion tokens); update TFLOP: the update's useful FLOPs (every pass: "
                 "forward and input gradient of the base and LoRA products, attention over the causal pairs and the "
                 "LM head, LoRA's weight gradients; no recomputation; qerl.rl.flops), update TFLOP/s: per GPU per "
                 "second of the update; GPU busy: the share of each phase's wall time the GPU ran kernels, from one "
                 "more step per cell under the profiler (--busy; '-' without it or where the phase did not run)")
    firsts = [f"{r['variant']} {r.get('mode', '-')} {r.get('prompts', '-')} prompts {r['first_step_s']:.1f} s"
              for r in results if "first_step_s" in r]
    if firsts:
        lines.append("\nfirst (warm-up) step, kernel compilation and graph capture included: " + ", ".join(firsts))
    if orders:
        lines.append("\norders (rounds alternate between them): "
                     + "; ".join(f"{i + 1}: {o}" for i, o in enumerate(orders)))
    if any("dist_grad_rel_err" in r for r in results):
        errs = [r["dist_grad_rel_err"] for r in results if "dist_grad_rel_err" in r]
        floor = [r["dist_grad_noise_floor"] for r in results if "dist_grad_noise_floor" in r]
        lines.append(f"\ndata-parallel gradient vs single process (relative L2 error): max {max(errs):.2e}"
                     + (f"; single process, micro-batch halved: max {max(floor):.2e}" if floor else ""))
    return "\n".join(lines)


def ceiling_table(results, device, args) -> str:
    """`step_ceiling`'s bound for every (model, prompts) cell with both bf16 and nvfp4 rows, one table per mode, or
    "" if none. Forced lengths only: the bound's KV-cache bytes assume every row has --completion tokens."""
    from .step_ceiling import cells, table as bound_table

    if args.profile is not None:
        return ""
    parts = []
    for mode in args.modes:
        rows = [r for r in results if r.get("mode") in (None, mode_label(mode))]  # model-OOM cells have no mode
        report = dict(device=device, date=str(datetime.date.today()), args=args_json(args), results=rows)
        name = "" if len(args.modes) == 1 else f" ({mode_label(mode)})"
        try:
            if cells(report):
                parts.append(f"ceiling of the NVFP4 step for 4-bit-weight kernels{name} (python -m "
                             "qerl.bench.step_ceiling --help):\n" + bound_table([("this run", report)]))
        except ValueError as e:  # the measurements above stand; only the bound is not computable
            parts.append(f"no ceiling for this run{name}: {e}")
    return "\n\n".join(parts)


def parse_modes(schedulers: str | None, packing: str | None, modes: str | None) -> list[tuple[str, bool]]:
    """--modes new,old, or the product --schedulers x --packing (defaults continuous, on) -> [(scheduler, packed)].
    Raises ValueError for unknown or repeated values."""
    if modes is not None:
        if schedulers is not None or packing is not None:
            raise ValueError("--modes replaces --schedulers and --packing; give one or the other")
        names = modes.split(",")
        unknown = [n for n in names if n not in MODES]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"--modes {modes!r}: a comma list of distinct {', '.join(MODES)}")
        return [MODES[n] for n in names]
    packs = (packing or "on").split(",")
    if any(p not in PACKING for p in packs) or len(set(packs)) != len(packs):
        raise ValueError(f"--packing {packing!r}: a comma list of distinct on, off")
    return [(s, PACKING[p]) for s in parse_schedulers(schedulers or "continuous") for p in packs]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b", help=f"comma list of {','.join([*QWEN25, *MOE_SHAPES])}")
    ap.add_argument("--variants", default="bf16,nf4,nvfp4,nvfp4+aqn",
                    help="FORMAT[+aqn][+dense|+denseall][+w4a8], FORMAT in bf16,nf4,nvfp4,mxfp4,fp8")
    ap.add_argument("--prompts", default="2,4,8", help="prompts per step (global, over all ranks)")
    ap.add_argument("--group", type=int, default=8, help="G completions per prompt")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=None,
                    help="forced lengths: every row exactly this many tokens (default 2048); not with --lengths")
    add_lengths_option(ap)
    ap.add_argument("--seed", type=int, default=0, help="--lengths: repetition r draws with seed + r")
    ap.add_argument("--schedulers", default=None, help="comma list of continuous, static (default continuous)")
    ap.add_argument("--packing", default=None, help="comma list of on (packed micro-batches), off (padded); default on")
    ap.add_argument("--packed-attention", default="sdpa", choices=PACKED_ATTENTION, help="optim.packed_attention")
    ap.add_argument("--modes", default=None, help="comma list of new, old; instead of --schedulers / --packing")
    ap.add_argument("--warmup-completion", type=int, default=32, help="length of the untimed warm-up step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per cell and order (medians: use 3 or more)")
    ap.add_argument("--order", choices=("interleaved", "sequential"), default="sequential")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch of the padded update")
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                    help="tokens per micro-batch of the packed update (default: qerl.rl.packing.token_budget)")
    ap.add_argument("--release-kv-cache", choices=tuple(RELEASE_SETTINGS), default="auto",
                    help="as rollout.release_kv_cache, for the non-old modes (old always frees)")
    ap.add_argument("--gradient-checkpointing", choices=tuple(CHECKPOINTING_SETTINGS), default="auto",
                    help="as optim.gradient_checkpointing")
    ap.add_argument("--moe-reference", action="store_true", help="MoE models: the per-expert reference loop")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--kl-beta", type=float, default=0.04, help="0 skips the reference pass")
    ap.add_argument("--sigma", type=float, default=1e-2, help="AQN sigma of +aqn variants")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke tests)")
    ap.add_argument("--memory-cap-gib", type=float, default=None, help="limit this process's GPU memory")
    ap.add_argument("--check-dist", action="store_true", help="under torchrun: check the all-reduced gradient")
    ap.add_argument("--busy", action="store_true", help="one more step per cell, each phase profiled: GPU busy")
    ap.add_argument("--profile-update", action="store_true", help="one more step per cell, its update profiled")
    add_policy_option(ap, "permute_x=false; disabled=BACKEND+BACKEND)")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)
    parse_policy(ap, args)
    args.models = args.models.split(",")
    args.variants = args.variants.split(",")
    args.prompts = [int(p) for p in args.prompts.split(",")]
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.group < 1 or args.prompt < 1 or args.micro_batch < 1 or min(args.prompts) < 1:
        ap.error("--group, --prompt, --micro-batch and --prompts must be >= 1")
    if len(set(args.variants)) != len(args.variants):
        ap.error(f"--variants lists a variant twice: {','.join(args.variants)}")
    for size in args.models:
        model_config(size, 1)
    for v in args.variants:
        or_error(ap, _variant, v)
    args.modes = or_error(ap, parse_modes, args.schedulers, args.packing, args.modes)
    args.profile, args.completion, args.budget = resolve_lengths(ap, args.lengths, args.completion, "--completion",
                                                                 2048, 1)
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
    with kernel_policy(**args.policy):
        results = run(args, dist_ctx)
    barrier(dist_ctx)
    if dist_ctx.is_main:
        device = torch.cuda.get_device_name()
        print(table(results, device, args))
        bound = ceiling_table(results, device, args)
        if bound:
            print("\n" + bound)
        if args.profile_update:
            print("\nthe policy update under the profiler (one untimed step per cell; the first repetition's "
                  "lengths):\n" + profile_table(results))
    if dist_ctx.enabled:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
