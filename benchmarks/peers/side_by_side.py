"""Every peer and qerl on one job, spread over the GPUs of one machine; then each trained adapter's held-out score
by one scorer (`qerl eval`), and the table of docs/peers.md.

    python benchmarks/peers/side_by_side.py --config configs/gsm8k-grpo-1.5b.yaml --steps 20 --seeds 0,1,2 \\
        --gpus 0,1,2,3 --out runs/peers
    python benchmarks/peers/side_by_side.py ... --jobs qerl-bf16,qerl-nvfp4,trl --dry-run   # the commands only
    python benchmarks/peers/side_by_side.py ... --report                                    # the table only

Jobs (--jobs, default all): qerl-bf16 and qerl-nvfp4 (`qerl train` with the config as it is, and as bf16 LoRA without
AQN), trl (TRL's GRPOTrainer with its colocated vLLM, its defaults), trl-fast (+ Liger's layer kernels, vLLM at half
the GPU), trl-sleep (+ vLLM sleep mode), unsloth-16bit, unsloth-4bit, unsloth-fp8 (`trl_grpo.py`, `unsloth_grpo.py`).
One process per (job, seed), each on the GPU running the fewest; a job's output goes to OUT/JOB_sSEED/run, its log to
OUT/JOB_sSEED/job.log. Installs nothing: a job whose peer is missing fails with its log's error in the table and the
others go on. Run again to finish what is missing: a finished job (its result file exists) or evaluation is kept.

Every job trains on the same prompts in the same steps: OUT/prompts_sSEED.jsonl holds the rows qerl's trainer draws
for that seed, step by step (its own `PromptStream`, through `trl_grpo.prompt_order`), and every peer job is fed that
file (`--prompts`), unshuffled; its result records the digest of what it was fed, and the table checks it. Every
job applies qerl's truncated importance sampling, w_t = min(pi_old / mu, tis_cap) per token with mu the sampler's
log-probs: qerl's own, TRL's (`vllm_importance_sampling_correction`, token_truncate at the same cap) and Unsloth's
(the same TRL options, which its patched loss honours). What still differs per job, and why, is the `differs` note
of each row (`DIFFERS`; docs/peers.md, "What is the same and what differs").

Each trained adapter is then scored greedily on the held-out problems (`--test`, default the config's
`gsm8k-offline:heldout`, first --eval-limit) on the 16-bit model (how a peer's adapter is served, merged), and a
4-bit qerl job's also on its own base (`--format` / `--keep-bf16` of its config). Unsloth's 4-bit and FP8 adapters
are scored on the 16-bit model too (qerl does not load bitsandbytes or Unsloth's FP8 bases).

The table: median seconds per optimizer step over steps 3..N (device synchronised; qerl's `time_step`), time to the
first finished step (peers: from the script's start, imports included; qerl: from the trainer's creation, so a few
seconds of imports less), peak memory (torch's allocator; the peers' also the device's used memory, which counts
vLLM's pools), the mean reward of the first and last five steps, held-out pass@1 (flexible / strict): means over
seeds; the importance-sampling correction and the prompt order each job used; then each job's `differs` note.
Also written to OUT/side_by_side.json.
"""

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable
sys.path.insert(0, str(HERE))
from trl_grpo import model_directory, order_digest, prompt_order, write_prompt_order  # noqa: E402

# with its tokenizer repair (fix_tokenizer) on, Unsloth's load stops in its pad-token check on this model's upstream
# tokenizer (docs/peers.md); off, its loader returns the directory's fast tokenizer as TRL and qerl load it
_UNSLOTH_TOKENIZER = ("--tokenizer-repair", "off")
# job -> (script or "qerl", extra arguments); the qerl jobs' arguments are config overrides
JOBS = {
    "qerl-nvfp4": ("qerl", []),
    "qerl-bf16": ("qerl", ["model.format=bf16", "model.keep_bf16=[]", "aqn.enabled=false"]),
    "trl": ("trl_grpo.py", []),
    "trl-fast": ("trl_grpo.py", ["--liger", "--gpu-memory-utilization", "0.5"]),
    "trl-sleep": ("trl_grpo.py", ["--sleep"]),
    "unsloth-16bit": ("unsloth_grpo.py", ["--weights", "16bit", *_UNSLOTH_TOKENIZER]),
    "unsloth-4bit": ("unsloth_grpo.py", ["--weights", "4bit", *_UNSLOTH_TOKENIZER]),
    "unsloth-fp8": ("unsloth_grpo.py", ["--weights", "fp8", *_UNSLOTH_TOKENIZER]),
}
RESULT_FILE = {"trl_grpo.py": "trl.json", "unsloth_grpo.py": "unsloth.json"}
PROGRESS_FILE = "progress.json"  # a peer job's measurements so far (trl_grpo.step_timer), kept when it stops early

# what every job runs alike, from the one config (trl_grpo.grpo_settings maps it onto TRL's options)
SAME = (
    ("the model (Qwen2.5-Coder-1.5B-Instruct for the config; its base precision is per job), problems and their "
     "length filter, qerl's prompt template, qerl's reward functions and weights"),
    "sampling: temperature, top-p, top-k, max new tokens, group size, prompts per step",
    "the prompts of every step, in qerl's order (OUT/prompts_sSEED.jsonl, from qerl's PromptStream)",
    ("LoRA rank, alpha, dropout, targets (every linear), rsLoRA; AdamW (torch), learning rate and schedule, warmup, "
     "weight decay, gradient-norm clip"),
    ("loss: algo.name's objective and normaliser, clip_low / clip_high, KL beta, group-std advantages, one optimizer "
     "step per rollout batch"),
    "truncated importance sampling min(pi_old / mu, tis_cap) per token against the sampler's log-probs",
)

# what each job does differently from the job every one of them runs (docs/peers.md, "The job"), and why it cannot
# be the same; the settings, prompts, prompt order and importance-sampling correction are the same for all
_VLLM_TRL = ("sampler: TRL's colocated vLLM (bf16, the LoRA merged into its copy each step), a second engine beside "
             "the learner, so the mismatch TIS corrects is two implementations' numerics")
_PEER = (
    ("pi_old: a separate no-grad forward before the loss (TRL runs one whenever the IS correction is on; qerl's is "
     "the loss forward's own, detached): the same values, one more pass"),
    "advantage: (R - mean) / (std + 1e-4), TRL's fixed epsilon (qerl: 1e-6; ~3e-4 relative at 0/1 rewards)",
    "random draws: PEFT's LoRA A initialisation and the engine's sampling RNG are the peer's own, not qerl's",
)
_UNSLOTH = (
    ("TRL 1.15 (Unsloth's pin) patched by Unsloth: its own chunked GRPO loss with the same objective, normaliser, "
     "clipping and IS options; its gradient checkpointing"),
    ("sampler: Unsloth's vLLM engine sharing the base weights, the LoRA as a vLLM adapter; TIS on its raw log-probs, "
     "equal to the processed ones at temperature 1, top-p 1 and no top-k (this job)"),
)
_TRL_BASE = "base: bf16, no AQN (TRL has no 4-bit RL path)"
_QERL_SAMPLER = "sampler: qerl's engine on the training weights, in the same process"
DIFFERS = {
    "qerl-nvfp4": (("base: NVFP4 (the config's keep_bf16 layers 16-bit) with AQN noise on the sampler, what qerl "
                    "measures; TIS then corrects the noise as well as kernel numerics"), _QERL_SAMPLER),
    "qerl-bf16": ("base: bf16, no AQN", _QERL_SAMPLER),
    "trl": (_TRL_BASE, _VLLM_TRL, *_PEER),
    "trl-fast": (_TRL_BASE, _VLLM_TRL, *_PEER, "Liger's layer kernels and vLLM at half the GPU: speed only"),
    "trl-sleep": (_TRL_BASE, _VLLM_TRL, *_PEER, "vLLM sleep mode (its memory freed for the update): memory only"),
    "unsloth-16bit": ("base: bf16, no AQN", *_UNSLOTH, *_PEER),
    "unsloth-4bit": ("base: bitsandbytes NF4 (QLoRA) for sampler and learner, no AQN", *_UNSLOTH, *_PEER),
    "unsloth-fp8": ("base: FP8 for sampler and learner (Unsloth's FP8 RL), no AQN", *_UNSLOTH, *_PEER),
}


def order_file(out: Path, seed: int) -> Path:
    """The prompt order every job of `seed` trains on (module docstring)."""
    return out / f"prompts_s{seed}.jsonl"


def write_order_files(out: Path, seeds: list[int], args) -> None:
    """OUT/prompts_sSEED.jsonl for every seed whose file lacks rows for --steps steps: qerl's draws for the config
    with that seed (a longer file starts with the same rows: the stream is deterministic), on the tokenizer of the
    16-bit model the peers load (the length filter counts its tokens)."""
    from transformers import AutoTokenizer

    from qerl.config import load_config

    tokenizer = None
    for seed in seeds:
        cfg = load_config(args.config, [*args.set, f"seed={seed}"])
        path, need = order_file(out, seed), args.steps * cfg.rollout.prompts_per_step
        if path.is_file() and len(path.read_text().splitlines()) >= need:
            continue
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_directory(cfg.model.name))
        write_prompt_order(path, prompt_order(cfg, tokenizer, args.steps), cfg.rollout.prompts_per_step)


def qerl_importance_sampling(cfg) -> dict | None:
    """qerl's truncated importance sampling for `cfg`, in the peers' terms (`trl_grpo.importance_sampling`)."""
    if cfg.algo.tis_cap is None or cfg.algo.old_logprobs != "recompute":
        return None
    return {"mode": "token_truncate", "cap": cfg.algo.tis_cap}


@dataclass(frozen=True)
class Job:
    """What `qerl.study.run_jobs` runs: a name, its directory, its log and the file that says it is done."""

    name: str
    dir: Path
    log_path: Path
    result_path: Path
    argv: tuple[str, ...]


def train_job(out: Path, name: str, seed: int, args) -> Job:
    script, extra = JOBS[name]
    d = out / f"{name}_s{seed}"
    run = d / "run"
    if script == "qerl":
        argv = [PY, "-m", "qerl.cli", "train", "--config", args.config, "--output-dir", str(run), f"steps={args.steps}",
                f"seed={seed}", "save_every=0", *extra, *args.set]
        result = run / "adapter" / "adapter_config.json"
    else:
        argv = [PY, str(HERE / script), "--config", args.config, "--steps", str(args.steps), "--out", str(run),
                "--prompts", str(order_file(out, seed)), *extra, "--set", f"seed={seed}", *args.set]
        result = run / RESULT_FILE[script]
    return Job(f"{name}_s{seed}", d, d / "job.log", result, tuple(argv))


def eval_jobs(job: Job, name: str, cfg, args) -> list[Job]:
    """The held-out evaluations of a trained job's adapter: on the 16-bit model, and a 4-bit qerl job's on its base."""
    adapter = job.dir / "run" / "adapter"
    bases = [("16bit", [])]
    fmt = cfg.model.format if name == "qerl-nvfp4" else "bf16"
    if fmt != "bf16":
        keep = ",".join(cfg.model.keep_bf16)
        bases.append(("own", ["--format", fmt] + (["--keep-bf16", keep] if keep else [])))
    out = []
    for base, flags in bases:
        d = job.dir / f"eval_{base}"
        argv = [PY, "-m", "qerl.cli", "eval", cfg.model.name, "--adapter", str(adapter), "--dataset", args.test,
                "--greedy", "--max-new-tokens", str(cfg.rollout.max_new_tokens), "--limit", str(args.eval_limit),
                "--suffix", cfg.data.suffix, *flags, "--out", str(d / "eval.jsonl")]
        out.append(Job(f"{job.name}:{base}", d, d / "job.log", d / "eval.jsonl", tuple(argv)))
    return out


# the kept form of a job (`--archive`): per-problem scores without completions, no adapter
SCORES_FILE = "scores.jsonl"


def eval_scores(path: Path) -> dict | None:
    """pass@1 (flexible, the `math` reward) and strict from a `qerl eval --out` file (or its kept scores beside it),
    or None when absent."""
    if not path.is_file():
        path = path.with_name(SCORES_FILE)
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    mean = lambda key: statistics.mean(statistics.mean(r[key]) for r in rows)  # noqa: E731
    return {"pass1": mean("rewards"), "strict": mean("strict"), "problems": len(rows)}


def qerl_metrics(job: Job) -> list[dict]:
    """The per-step rows of a qerl job's metrics.jsonl ([] when absent)."""
    path = job.dir / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def train_summary(job: Job, script: str, steps: int) -> dict | None:
    """Step time, first step, peak memory and reward of a finished training job, from its own output (a qerl job
    kept without its adapter counts as finished when its metrics hold all `steps` steps)."""
    if not job.result_path.is_file() and (script != "qerl" or len(qerl_metrics(job)) < steps):
        return None
    if script != "qerl":
        r = json.loads(job.result_path.read_text())
        return {"median_step_s": r["median_step_s"], "first_step_s": r["time_to_first_step_s"],
                "peak_gb": r["peak_allocated_gb"], "device_used_gb": r.get("peak_device_used_gb"),
                "reward": r["reward"], "versions": r.get("versions", {}),
                "importance_sampling": applied(r), "prompt_order": r.get("prompt_order_sha256")}
    rows = qerl_metrics(job)
    steps = [r["time_step"] for r in rows]
    return {"median_step_s": statistics.median(steps[2:] or steps), "first_step_s": rows[0].get("time_to_first_step"),
            "peak_gb": max(r["memory_gb"] for r in rows), "device_used_gb": None,
            "reward": [r["reward"] for r in rows], "versions": {}}


def applied(result: dict) -> dict | None:
    """A peer result's importance-sampling setting, marked `"logged": False` when the trainer logged no IS weight
    (the options were passed but the correction did not run)."""
    setting = result.get("importance_sampling")
    if setting is None or result.get("importance_sampling_ratio_mean"):
        return setting
    return {**setting, "logged": False}


def order_check(out: Path, seed: int, digest: str | None, rows: int) -> bool:
    """Whether a peer job of `seed` was fed the first `rows` rows of that seed's order file (its result's digest
    equals theirs)."""
    path = order_file(out, seed)
    if digest is None or not path.is_file():
        return False
    return order_digest([json.loads(line) for line in path.read_text().splitlines()[:rows]]) == digest


def archive(plan: dict, cfg, args, dest: Path) -> int:
    """The kept form of every job in `plan` under `dest` (for docs/results): each job's logs, qerl's config and
    per-step metrics or a peer's result file, and per evaluation its per-problem scores (SCORES_FILE: rewards, strict,
    lengths; no completions, no adapters); then side_by_side.json. `--report` on `dest` reads it back. Files kept."""
    import shutil

    out, kept = Path(args.out), 0
    for name, jobs in plan.items():
        for job in jobs:
            files = [job.log_path, job.dir / "run" / "config.yaml", job.dir / "run" / "metrics.jsonl"]
            files += [job.dir / "run" / f for f in (*RESULT_FILE.values(), PROGRESS_FILE)]
            for e in eval_jobs(job, name, cfg, args):
                files.append(e.log_path)
                if e.result_path.is_file():
                    rows = [json.loads(line) for line in e.result_path.read_text().splitlines() if line.strip()]
                    target = dest / e.dir.relative_to(out) / SCORES_FILE
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text("".join(json.dumps({"i": i, "rewards": r["rewards"], "strict": r["strict"],
                                                          "lengths": r.get("lengths")}) + "\n"
                                              for i, r in enumerate(rows)))
                    kept += 1
            for f in files:
                if f.is_file():
                    target = dest / f.relative_to(out)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, target)
                    kept += 1
    if (out / "side_by_side.json").is_file():
        shutil.copyfile(out / "side_by_side.json", dest / "side_by_side.json")
    return kept


def mean_of(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def is_text(setting: dict | None | str) -> str:
    """An importance-sampling setting as the table prints it."""
    if isinstance(setting, dict) and setting.get("mode") == "token_truncate":
        return f"per token, cap {setting['cap']:g}" + (" (none logged)" if setting.get("logged") is False else "")
    return "off" if setting is None else str(setting)


def report(plan: dict, cfg, args, seeds: list[int]) -> list[dict]:
    """One row per job (means over its seeds) from what OUT holds; printed as a markdown table, then each job's
    `differs` note. Per row also the importance-sampling correction the job applied (a peer's from its result
    file, qerl's from the config) and its prompt order: qerl's own stream, or for a peer "qerl's" when every seed's
    result names the digest of that seed's order file, else "differs"."""
    table = []
    out, rows_fed = Path(args.out), args.steps * cfg.rollout.prompts_per_step
    for name, jobs in plan.items():
        script = JOBS[name][0]
        runs = [(seed, train_summary(j, script, args.steps), {e.name.split(":")[1]: eval_scores(e.result_path)
                                                  for e in eval_jobs(j, name, cfg, args)})
                for seed, j in zip(seeds, jobs)]
        done = [(seed, t, e) for seed, t, e in runs if t is not None]
        row = {"job": name, "seeds": len(done), "of": len(jobs)}
        partial = [json.loads(p.read_text()) for j in jobs if not j.result_path.is_file()
                   and (p := j.dir / "run" / PROGRESS_FILE).is_file()]
        if partial:  # stopped before its result file: what it measured, never mixed into the row's means
            row["partial"] = [{k: r.get(k) for k in ("steps_done", "median_step_s", "median_over",
                                                     "peak_allocated_gb", "reward")} for r in partial]
        if script == "qerl":
            row.update(importance_sampling=qerl_importance_sampling(cfg), prompt_order="qerl's stream")
        elif done:
            settings = [t["importance_sampling"] for _, t, _ in done]
            same = all(order_check(out, seed, t["prompt_order"], rows_fed) for seed, t, _ in done)
            row.update(importance_sampling=settings[0] if all(x == settings[0] for x in settings) else settings,
                       prompt_order="qerl's" if same else "differs")
        if done:
            score = lambda base, key: mean_of([e[base][key] if e.get(base) else None for _, _, e in done])  # noqa: E731
            row.update(
                median_step_s=mean_of([t["median_step_s"] for _, t, _ in done]),
                first_step_s=mean_of([t["first_step_s"] for _, t, _ in done]),
                peak_gb=mean_of([t["peak_gb"] for _, t, _ in done]),
                device_used_gb=mean_of([t["device_used_gb"] for _, t, _ in done]),
                reward_first5=mean_of([statistics.mean(t["reward"][:5]) for _, t, _ in done if t["reward"]]),
                reward_last5=mean_of([statistics.mean(t["reward"][-5:]) for _, t, _ in done if t["reward"]]),
                pass1_16bit=score("16bit", "pass1"), strict_16bit=score("16bit", "strict"),
                pass1_own=score("own", "pass1"), strict_own=score("own", "strict"),
                versions=done[0][1]["versions"])
        row["differs"] = list(DIFFERS[name])
        table.append(row)
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    print("| job | seeds | s / step (median, steps 3+) | first step s | peak GB (allocated / device) | "
          "reward first 5 -> last 5 | held-out pass@1, 16-bit base (strict) | on its own 4-bit base (strict) | "
          "importance sampling | prompt order |")
    print("|---|---:|---:|---:|---|---|---|---|---|---|")
    notes = []
    for r in table:
        stopped = "; ".join(f"stopped after {p['steps_done']} of {args.steps} steps: {fmt(p['median_step_s'])} "
                            f"s/step over {p['median_over']}, peak {fmt(p['peak_allocated_gb'], '.1f')} GB"
                            for p in r.get("partial", []))
        if not r["seeds"]:
            print(f"| {r['job']} | 0 of {r['of']} | {stopped or 'not run or failed'}: see its job.log | | | | | | | |")
            continue
        if stopped:  # some seeds finished, others stopped early: the row is the finished ones' means
            notes.append(f"- {r['job']}: besides the seeds in its row, {stopped}")
        print(f"| {r['job']} | {r['seeds']} of {r['of']} | {fmt(r['median_step_s'])} | "
              f"{fmt(r['first_step_s'], '.1f')} | {fmt(r['peak_gb'], '.1f')} / {fmt(r['device_used_gb'], '.1f')} | "
              f"{fmt(r['reward_first5'], '.3f')} -> "
              f"{fmt(r['reward_last5'], '.3f')} | {fmt(r['pass1_16bit'], '.3f')} ({fmt(r['strict_16bit'], '.3f')}) | "
              f"{fmt(r['pass1_own'], '.3f')} ({fmt(r['strict_own'], '.3f')}) | "
              f"{is_text(r['importance_sampling'])} | {r['prompt_order']} |")
    if notes:
        print("\n" + "\n".join(notes))
    print("\nWhat differs, per job (the rest is the same for every job: docs/peers.md):")
    for r in table:
        print(f"- {r['job']}: " + "; ".join(r["differs"]))
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/gsm8k-grpo-1.5b.yaml")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="qerl config overrides for every job")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", default="0", help="comma-separated")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--gpus", default="0", help="CUDA devices to spread the jobs over, e.g. 0,1,2,3")
    ap.add_argument("--parallel", type=int, default=0, help="training jobs at once (default: one per GPU)")
    ap.add_argument("--eval-parallel", type=int, default=0,
                    help="evaluations at once (default: --parallel); they time nothing, so several may share a GPU")
    ap.add_argument("--no-eval", action="store_true", help="train only; a later run evaluates what is finished")
    ap.add_argument("--test", default="gsm8k-offline:heldout")
    ap.add_argument("--eval-limit", type=int, default=500)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--report", action="store_true", help="only the table from what --out holds")
    ap.add_argument("--archive", metavar="DIR", help="also copy the kept form of every job here (logs, metrics, "
                                                      "result files, per-problem scores; no completions or adapters)")
    args = ap.parse_args(argv)
    from qerl.study import run_jobs, write_json_atomic
    from qerl.config import load_config

    names = [n.strip() for n in args.jobs.split(",") if n.strip()]
    unknown = [n for n in names if n not in JOBS]
    if unknown:
        ap.error(f"unknown job(s) {', '.join(unknown)}; choose from {', '.join(JOBS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: comma-separated integers")
    if args.steps < 1 or args.eval_limit < 1 or not seeds:
        ap.error("--steps and --eval-limit must be >= 1, and --seeds must name one seed or more")
    if args.parallel < 0 or args.eval_parallel < 0:
        ap.error("--parallel and --eval-parallel must be >= 0 (0: the default)")
    cfg = load_config(args.config, args.set)
    out = Path(args.out)
    plan = {n: [train_job(out, n, s, args) for s in seeds] for n in names}
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    parallel = args.parallel or len(gpus)

    if not args.report:
        train = [j for jobs in plan.values() for j in jobs if not j.result_path.is_file()]
        if args.dry_run:
            for j in train:
                print(shlex.join(j.argv))
        else:
            if any(JOBS[n][0] != "qerl" for n in names):  # the peers' input: qerl's prompt order, per seed
                write_order_files(out, seeds, args)
            run_jobs(train, lambda j: list(j.argv), parallel=parallel, devices=gpus)
        evals = [e for name, jobs in plan.items() for j in jobs for e in eval_jobs(j, name, cfg, args)
                 if (args.dry_run or j.result_path.is_file()) and not e.result_path.is_file()]
        if args.no_eval:
            evals = []
        if args.dry_run:
            for e in evals:
                print(shlex.join(e.argv))
            return 0
        run_jobs(evals, lambda e: list(e.argv), parallel=args.eval_parallel or parallel, devices=gpus)
    table = report(plan, cfg, args, seeds)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "side_by_side.json", {"config": args.config, "overrides": args.set, "steps": args.steps,
                                                  "seeds": seeds, "test": args.test, "eval_limit": args.eval_limit,
                                                  "same_for_every_job": list(SAME), "rows": table})
    if args.archive:
        print(f"kept {archive(plan, cfg, args, Path(args.archive))} files in {args.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
