"""The paper-effects study (docs/results.md): several arms x several seeds of RL on one model, held-out
pass@1 before/after, reward and entropy curves, time split and memory, aggregated as mean and spread over
seeds. `qerl bench study` (or `python -m qerl.study`) runs it; this module holds the jobs and the command,
with arms in `qerl.study.arms`, the subprocess runner in `.jobs`, aggregation and plots in `.report`, the
claim verdicts in `.claims` and the learning-rate sweep in `.lr`.

    qerl bench study --model smollm2-135m-instruct --train reasoning-gym:basic_arithmetic \\
        --test reasoning-gym:basic_arithmetic --arms nvfp4+aqn,nvfp4,bf16,bf16+aqn,nf4 --seeds 0,1,2 \\
        --steps 30 --parallel 8 --deadline-s 510 --out runs/study

An arm is FORMAT[-METHOD][/INIT][+aqn][:DECAY][@LR]: FORMAT a weight format (nvfp4, mxfp4, nf4, bf16), METHOD how it is
quantized (rtn, 4over6, gptq, awq; rtn when omitted), INIT how its adapter starts (lora.init: loftq, eora; zero
when omitted), +aqn turns Adaptive Quantization Noise on, DECAY
(exponential, linear, cosine, logarithmic; only with +aqn) is its sigma decay, exponential when omitted
("nvfp4+aqn:exponential" is the same arm as "nvfp4+aqn"), @LR its own learning rate (a sweep per format:
nvfp4@1e-4,nvfp4@5e-4,bf16@1e-4,...). Every (arm, seed) job gets the same data, steps and other
hyper-parameters; the same seed gives the same data order and LoRA
initialisation in every arm.

Each job runs in its own Python process (its own CUDA context; a 135M model leaves one GPU mostly idle, so
--parallel N of them multiply throughput) and writes --out/<arm>_s<seed>/result.json the moment it is done,
next to the trainer's metrics.jsonl and the job's log (job.log). A killed study loses nothing finished:
running the same command again skips every job whose result.json exists (after checking it was made with
the same settings) and runs only the missing ones; a job killed mid-run (the --deadline-s, a lost machine)
continues from its last checkpoint (`save_every`) with its held-out "before" score kept, unless --no-resume.
To redo a job, delete its directory. On a machine with several GPUs the jobs are spread over them (--gpus),
each job on one GPU. --eval-16bit-base also scores each 4-bit arm's trained adapter on the 16-bit model
(`pass1_after_16bit` and its strict score `pass1_after_16bit_strict`; a bf16 arm's are its own after-RL scores):
the after-RL score split into what the adapter learned and what the 4-bit base costs it (docs/results.md, "The gap
is in the base").
"""

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..data.datasets import GSM8K_HELDOUT, GSM8K_TRAIN_OFFLINE, HELDOUT_OF
from .arms import Arm, StudyError, parse_arms
from .claims import claims, claims_markdown
from .jobs import MPSDaemon, run_jobs, write_json_atomic
from .lr import best_lrs, lr_groups, lr_sweep_markdown
from .report import aggregate, plot_study, report

DEFAULT_TEST = "reasoning-gym:basic_arithmetic"
# What the study itself sets per job; --set may not override them (the arm / seed would silently lie).
STUDY_KEYS = ("model.name", "model.format", "model.quant_method", "aqn.enabled", "aqn.decay", "data.train", "steps",
              "seed", "output_dir")


# arms, seeds, jobs --------------------------------------------------------------------------------


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise StudyError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise StudyError(f"--seeds {text!r}: expected distinct non-negative integers, e.g. 0,1,2")
    return seeds


def scoped_override(item: str) -> tuple[str | None, str]:
    """A --set item as (format it is limited to or None, section.key=value): `nf4:model.dense_weights=all`
    applies to the nf4 arms only."""
    head = item.split("=", 1)[0]
    if ":" not in head:
        return None, item
    fmt, rest = item.split(":", 1)
    return fmt.strip(), rest


def check_overrides(overrides: list[str]) -> None:
    from ..formats import FORMATS

    for item in overrides:
        fmt, plain = scoped_override(item)
        if fmt is not None and fmt not in FORMATS:
            raise StudyError(f"--set {item}: {fmt!r} is not a weight format; FORMAT:section.key=value limits a "
                             f"setting to the arms of one format ({', '.join(FORMATS)})")
        key = plain.split("=", 1)[0].strip()
        if key in STUDY_KEYS:
            raise StudyError(f"--set {item}: the study sets {key} itself (use --model, --arms, --train, --steps, "
                             "--seeds or --out)")


@dataclass(frozen=True)
class Job:
    arm: Arm
    seed: int
    out: Path

    @property
    def name(self) -> str:
        return f"{self.arm.slug}_s{self.seed}"

    @property
    def dir(self) -> Path:
        return self.out / self.name

    @property
    def result_path(self) -> Path:
        return self.dir / "result.json"

    @property
    def log_path(self) -> Path:
        return self.dir / "job.log"


def make_jobs(arms: list[Arm], seeds: list[int], out: Path) -> list[Job]:
    """Seed-major order: if the deadline cuts the study short, what finished are whole seeds of every arm,
    which compare fairly, rather than every seed of the first arms."""
    return [Job(arm, seed, Path(out)) for seed in seeds for arm in arms]


def load_result(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def comparable_config(cfg) -> dict:
    """A job's resolved configuration as a dict, without what differs between the seeds of one arm (seed,
    output_dir): what its result records, so that a changed config file is not mistaken for the same arm."""
    from ..config import to_dict

    # through JSON, so that it compares equal to the copy read back from result.json (tuples become lists)
    return json.loads(json.dumps({k: v for k, v in to_dict(cfg).items() if k not in ("seed", "output_dir")}))


def config_diffs(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested config dicts. The noise settings of a run with AQN
    off in both (`aqn.enabled` false) are inert and not compared: a config file whose σ changed between two
    studies still ran the same bf16 or no-AQN arm."""
    if not prefix:
        a, b = _without_inert_aqn(a), _without_inert_aqn(b)
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += config_diffs(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}")
    return out


def _without_inert_aqn(config: dict) -> dict:
    aqn = config.get("aqn")
    if isinstance(aqn, dict) and aqn.get("enabled") is False:
        return {**config, "aqn": {"enabled": False}}
    return config


def split_finished(jobs: list[Job], settings: dict, configs: dict | None = None) -> tuple[list[Job], list[Job]]:
    """(jobs still to run, jobs whose result.json exists). A finished result made with other settings, or (where
    it recorded one) with another resolved config than `configs[job]` would give now (an edited config file), is
    refused rather than mixed in: the aggregate would silently average different experiments."""
    todo, done = [], []
    for job in jobs:
        if not job.result_path.is_file():
            todo.append(job)
            continue
        result = load_result(job.result_path)
        saved = result.get("settings", {})
        diffs = [f"{k}: {saved.get(k)!r} there, {v!r} now" for k, v in settings.items() if saved.get(k) != v]
        if configs is not None and job in configs and "config" in result:
            diffs += [f"config {k} differs" for k in config_diffs(result["config"], configs[job])]
        if diffs:
            raise StudyError(f"{job.result_path} was made with other settings ({'; '.join(diffs)}); use another "
                             "--out or delete that directory")
        done.append(job)
    return todo, done


# one job, in its own process ----------------------------------------------------------------------


def settings_of(args) -> dict:
    """Everything besides arm and seed that defines a job's result (checked when skipping finished jobs)."""
    return {"model": args.model, "config": args.config, "train": args.train, "test": args.test, "steps": args.steps,
            "eval_limit": args.eval_limit, "eval_n": args.eval_n, "eval_temperature": args.eval_temperature,
            "set": list(args.set)}


def job_overrides(args, job: Job) -> list[str]:
    # the arm's keys come last so that they win; check_overrides keeps --set off them anyway
    return [f"model.name={args.model}", f"data.train={args.train}", f"steps={args.steps}", f"seed={job.seed}",
            f"output_dir={job.dir}", "tensorboard=false", *arm_sets(args.set, job.arm), *job.arm.overrides()]


def arm_sets(items: list[str], arm) -> list[str]:
    """The --set items that apply to `arm`: the unscoped ones and those scoped to its format."""
    out = []
    for item in items:
        fmt, plain = scoped_override(item)
        if fmt is None or fmt == arm.format:
            out.append(plain)
    return out


def device_name() -> str:
    import platform

    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"


def summarize(metrics: list[dict]) -> dict:
    """The per-run numbers of the table from the trainer's per-step metrics: first / last 20% of the steps."""
    k = max(1, len(metrics) // 5)

    def mean(key, rows):
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {"reward_first": mean("reward", metrics[:k]), "reward_last": mean("reward", metrics[-k:]),
            "entropy_first": mean("entropy", metrics[:k]), "entropy_last": mean("entropy", metrics[-k:]),
            "time_rollout": mean("time_rollout", metrics), "time_update": mean("time_update", metrics),
            "memory_gb": max((r["memory_gb"] for r in metrics if r.get("memory_gb") is not None), default=None)}


def started_job_state(job: Job, settings: dict) -> dict | None:
    """What a killed earlier attempt of `job` left to continue from ({"pass1_before": ...} once measured), or
    None for a fresh directory; StudyError when that attempt ran with other settings (mixing them would make
    one result out of two experiments)."""
    path = job.dir / "job_state.json"
    if not path.is_file():
        return None
    state = load_result(path)
    if state.get("settings") != settings:
        raise StudyError(f"{job.dir} holds an unfinished run made with other settings; use another --out or "
                         "delete that directory")
    return state


def run_job(args, job: Job, fraction: float | None = None) -> dict:
    """Train one arm with one seed in this process; held-out pass@1 before and after; write result.json.
    Continues a run an earlier attempt left in the job's directory (see `started_job_state`). fraction: cap
    torch's allocator at that share of the GPU first (jobs sharing one GPU); the engine's cache sizing and the
    recompute plan read it back (`qerl.rollout.memory.process_memory`)."""
    import torch

    if fraction is not None and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)
    from ..config import load_config
    from ..data import load_problems
    from ..eval.evaluate import evaluate
    from ..rl.run_log import read_metrics
    from ..rl.trainer import Trainer
    from ..rollout.sampling import SamplingParams

    t_job = time.perf_counter()
    cfg = load_config(args.config, job_overrides(args, job))
    # the held-out problems are the same for every seed (seed 0), so the spread over seeds is the training's
    test_rows = load_problems(args.test, split="test", limit=args.eval_limit, seed=0) if args.eval_limit else None
    settings = {**settings_of(args), "arm": job.arm.name, "seed": job.seed}
    state = started_job_state(job, settings) if args.resume else None
    started = (job.dir / "metrics.jsonl").exists() or (job.dir / "config.yaml").exists()
    trainer = Trainer(cfg, resume="auto" if args.resume and started else None)
    if state is None:
        state = {"settings": settings, "attempts": 0}
    sampling = SamplingParams(args.eval_temperature, 0, 0.95)

    def held_out(when: str) -> dict:
        """{"pass1_<when>": flexible pass@1, "pass1_<when>_strict", "no_answer_<when>", "format_<when>"}; the
        values are None with --eval-limit 0 (a learning-rate sweep leaves the held-out set alone)."""
        if test_rows is None:
            return {f"pass1_{when}": None}
        with trainer.kernel_routing():  # the policy as it trains (model.compute fp8: W4A8 where it routes)
            res = evaluate(trainer.model, trainer.tokenizer, test_rows, n_samples=args.eval_n, sampling=sampling,
                           max_new_tokens=cfg.rollout.max_new_tokens, suffix=cfg.data.suffix, seed=job.seed,
                           engine=trainer.engine, progress=False)
        return {f"pass1_{when}": res["pass@1"], f"pass1_{when}_strict": res["pass@1_strict"],
                f"no_answer_{when}": res["no_answer"], f"format_{when}": res["format_followed"]}

    if "pass1_before" not in state:
        state.update(held_out("before"))
    state["attempts"] += 1
    write_json_atomic(job.dir / "job_state.json", state)
    # a job_state.json from before the strict scores has only pass1_before
    before = {k: state[k] for k in ("pass1_before", "pass1_before_strict", "no_answer_before", "format_before")
              if k in state}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    adapter = trainer.train()
    after_scores = held_out("after")
    after_16bit = {}
    if args.eval_16bit_base and test_rows is not None:
        if job.arm.format == "bf16":  # its base is the 16-bit model
            after_16bit = {k.replace("_after", "_after_16bit"): v for k, v in after_scores.items()}
        else:
            del trainer  # its 4-bit model and optimizer state make room for the 16-bit model
            after_16bit = held_out_on_16bit_base(cfg, adapter, test_rows, args, job.seed)
    metrics = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    # training time over every attempt: the steps' own wall times (a resumed run redoes none of them twice)
    seconds = sum(m.get("time_step") or 0.0 for m in metrics)
    result = {"arm": job.arm.name, "seed": job.seed, "format": job.arm.format, "method": job.arm.method,
              "aqn": job.arm.aqn,
              "decay": job.arm.decay if job.arm.aqn else None, **before, **after_scores,
              **after_16bit,
              "seconds": seconds, **summarize(metrics), "job_seconds": time.perf_counter() - t_job,
              "attempts": state["attempts"],
              "device": device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "settings": settings_of(args), "config": comparable_config(cfg), "metrics": metrics}
    write_json_atomic(job.result_path, result)
    return result


def held_out_on_16bit_base(cfg, adapter: Path, rows: list[dict], args, seed: int) -> dict:
    """Held-out scores of a trained adapter on the unquantized model (as `qerl eval MODEL --adapter DIR` scores
    it): the same problems, sampling, token limit, prompt suffix and seed as the job's own evaluations.
    {"pass1_after_16bit": flexible pass@1, "pass1_after_16bit_strict", "no_answer_after_16bit",
    "format_after_16bit"}, as the job's own "after" scores."""
    import gc

    import torch

    from ..eval.evaluate import evaluate
    from ..models import quant_layers
    from ..models.loader import ModelSpec, load_policy
    from ..rollout.sampling import SamplingParams

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # "bf16": the quantized layer's 16-bit form, which the adapter attaches to (as `qerl eval --adapter` does)
    model, tokenizer = load_policy(ModelSpec(name=cfg.model.name, format="bf16", adapter=str(adapter),
                                             dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code))
    formats = {layer.weight_format for layer in quant_layers(model).values()}
    if formats - {"bf16"}:  # main() refuses quantized checkpoints up front; this catches any other way in
        raise StudyError(f"--eval-16bit-base: {cfg.model.name} loaded as {sorted(formats)}, not the 16-bit model")
    sampling = SamplingParams(args.eval_temperature, 0, 0.95)
    res = evaluate(model, tokenizer, rows, n_samples=args.eval_n, sampling=sampling,
                   max_new_tokens=cfg.rollout.max_new_tokens, suffix=cfg.data.suffix, seed=seed, progress=False)
    return {"pass1_after_16bit": res["pass@1"], "pass1_after_16bit_strict": res["pass@1_strict"],
            "no_answer_after_16bit": res["no_answer"], "format_after_16bit": res["format_followed"]}


def check_16bit_model(model: str) -> None:
    """StudyError when `model` is a local quantized checkpoint: --eval-16bit-base needs the 16-bit model."""
    from ..models.pretrained import is_quantized_checkpoint

    if is_quantized_checkpoint(model):
        raise StudyError(f"--eval-16bit-base: {model} is a quantized checkpoint; give the 16-bit model the arms "
                         "quantize (--model) to score the adapters on it")


def job_command(args, job: Job, fraction: float | None = None) -> list[str]:
    """The argv that runs `job` alone in a fresh interpreter (`--job`), capped at `fraction` of its GPU if given."""
    cmd = [sys.executable, "-m", "qerl.study", "--job", "--arms", job.arm.name, "--seeds", str(job.seed),
           "--model", args.model, "--config", args.config, "--train", args.train, "--test", args.test,
           "--eval-limit", str(args.eval_limit), "--eval-n", str(args.eval_n),
           "--eval-temperature", str(args.eval_temperature), "--steps", str(args.steps), "--out", str(args.out)]
    for item in args.set:
        cmd += ["--set", item]
    if not args.resume:
        cmd.append("--no-resume")
    if args.eval_16bit_base:
        cmd.append("--eval-16bit-base")
    if fraction is not None:
        cmd += ["--gpu-memory-fraction", str(fraction)]
    return cmd


# share of a GPU the jobs that run on it at once may fill together, each its equal part (the rest: each process's
# CUDA context and kernels, which torch's allocator does not count)
SHARED_GPU_FRACTION = 0.9


def memory_fraction(option: str, parallel: int, devices: list[str] | None) -> float | None:
    """--gpu-memory-fraction -> the share of its GPU each job may allocate, or None (no cap). auto: with more
    than one job at a time on one GPU, SHARED_GPU_FRACTION split evenly between them (so one job's engine
    cache or activations cannot take what the others need); none; or a number in (0, 1]."""
    if option == "none":
        return None
    if option == "auto":
        per_gpu = -(-parallel // len(devices)) if devices else parallel
        return round(SHARED_GPU_FRACTION / per_gpu, 4) if per_gpu > 1 else None
    try:
        fraction = float(option)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise StudyError(f"--gpu-memory-fraction {option!r}: expected auto, none or a share in (0, 1]")
    return fraction


def job_env(parallel: int) -> dict:
    """The children's environment: the same qerl as this process, CPU threads shared out between them (each
    is mostly one Python thread feeding the GPU; N processes x all cores of intra-op threads thrash)."""
    import qerl

    env = dict(os.environ)
    src = str(Path(qerl.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, parallel))))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"  # job.log shows progress as it happens
    return env


# the command --------------------------------------------------------------------------------------


def build_parser(description: str = __doc__, prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--config", default="configs/smollm2-demo.yaml")
    p.add_argument("--train", default="reasoning-gym:basic_arithmetic")
    p.add_argument("--test", default=None,
                   help=f"held-out evaluation source; default {GSM8K_HELDOUT} when --train is {GSM8K_TRAIN_OFFLINE}, "
                        f"else {DEFAULT_TEST}")
    p.add_argument("--eval-limit", type=int, default=200,
                   help="held-out problems scored before and after RL; 0: none (a learning-rate sweep, which "
                        "picks each arm's rate by training reward; docs/results.md)")
    p.add_argument("--eval-n", type=int, default=4)
    p.add_argument("--eval-temperature", type=float, default=0.6)
    p.add_argument("--eval-16bit-base", action="store_true",
                   help="also score each 4-bit arm's trained adapter on the unquantized model after RL "
                        "(pass1_after_16bit; loaded once the job's trainer is released). --model must be the "
                        "16-bit model, not a quantized checkpoint")
    p.add_argument("--arms", default="nvfp4+aqn,nvfp4,bf16", help="FORMAT[-METHOD][/INIT][+aqn][:DECAY][@LR],...")
    p.add_argument("--seeds", "--seed", default="0", help="comma-separated, e.g. 0,1,2: every arm once per seed")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--set", action="append", default=[],
                   help="section.key=value for every job; FORMAT:section.key=value for that format's arms only "
                        "(e.g. nf4:model.dense_weights=all)")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--parallel", type=int, default=1, help="jobs run at once, each in its own process")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no job after this many seconds, kill those still running, then aggregate")
    p.add_argument("--mps", action="store_true", help="run the CUDA MPS daemon for the study (if installed)")
    p.add_argument("--gpu-memory-fraction", default="auto",
                   help="share of its GPU each job may allocate (torch's per-process memory fraction): auto (with "
                        "several jobs at once on one GPU, "
                        f"{SHARED_GPU_FRACTION} split evenly between them; otherwise no cap), none, or a number "
                        "in (0, 1]")
    p.add_argument("--gpus", default="auto",
                   help="CUDA devices to spread the jobs over, e.g. 0,1 (auto: every visible GPU; none: leave "
                        "CUDA_VISIBLE_DEVICES alone)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="start unfinished jobs again from step 0 instead of continuing from their last checkpoint")
    p.add_argument("--job", action="store_true", help="internal: run the single (arm, seed) in this process")
    return p


def main(argv=None, description: str = __doc__, prog: str = "qerl bench study") -> int:
    t_start = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(description, prog).parse_args(argv)
    if args.test is None:
        args.test = default_test(args.train)
    try:
        arms, seeds = parse_arms(args.arms), parse_seeds(args.seeds)
        check_overrides(args.set)
        if any(a.lr is not None for a in arms) and any(scoped_override(i)[1].split("=", 1)[0].strip() == "optim.lr"
                                                          for i in args.set):
            raise StudyError("--set optim.lr and an arm's @LR both set the learning rate; give one or the other")
        if args.eval_limit < 0:
            raise StudyError(f"--eval-limit must be >= 0 (0: no held-out evaluation), got {args.eval_limit}")
        if args.eval_16bit_base:
            check_16bit_model(args.model)
        if args.parallel < 1:
            raise StudyError(f"--parallel must be >= 1, got {args.parallel}")
        jobs = make_jobs(arms, seeds, Path(args.out))
        if args.job:
            if len(jobs) != 1:
                raise StudyError("--job runs exactly one arm and one seed")
            run_job(args, jobs[0], memory_fraction(args.gpu_memory_fraction, 1, None))
            return 0
        configs = _check_configs(args, jobs)
        todo, finished = split_finished(jobs, settings_of(args), configs)
        devices = job_devices(args.gpus)
        fraction = memory_fraction(args.gpu_memory_fraction, args.parallel, devices)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    overlap = overlap_check(args.train, args.test, args.eval_limit, seeds[0]) if args.eval_limit else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for job in finished:
        print(f"[cached] {job.name}: {job.result_path} exists")
    if args.parallel > 1:
        print(f"note: {args.parallel} jobs share the machine at a time; their wall times (train s, rollout and "
              "update s/step) are inflated relative to solo runs")
    deadline = t_start + args.deadline_s if args.deadline_s is not None else None
    if devices:
        print(f"jobs spread over GPUs {','.join(devices)}")
    if fraction is not None:
        print(f"each job may allocate {fraction:.0%} of its GPU (--gpu-memory-fraction)")
    with MPSDaemon(args.mps):
        outcomes = run_jobs(todo, lambda job: job_command(args, job, fraction), args.parallel, deadline,
                            job_env(args.parallel),
                            resume=args.resume, devices=devices)
    outcomes += [{"job": job, "status": "cached", "wall_s": 0.0, "error": "", "log_tail": ""} for job in finished]
    outcomes.sort(key=lambda o: jobs.index(o["job"]))
    runs = [load_result(o["job"].result_path) for o in outcomes if o["status"] in ("done", "cached")]
    agg = aggregate(runs, [a.name for a in arms])
    meta = {"model": args.model, "steps": args.steps, "seeds": seeds, "parallel": args.parallel,
            "gpu_memory_fraction": fraction,
            "device": next((r["device"] for r in runs if r.get("device")), "unknown (no finished run)"),
            "date": time.strftime("%Y-%m-%d"), "command": shlex.join([*shlex.split(prog), *argv])}
    write_json_atomic(out / "results.json", {
        **meta, "mps": args.mps, "args": vars(args), "settings": settings_of(args), "overlap": overlap,
        "aggregate": agg,
        "jobs": [{"name": o["job"].name, "arm": o["job"].arm.name, "seed": o["job"].seed,
                  **{k: o[k] for k in ("status", "wall_s", "error", "log_tail")}} for o in outcomes],
        "runs": runs})
    if runs:
        for path in plot_study(runs, agg, out):
            print(f"plot: {path}")
    print()
    print(report(agg, outcomes, meta))
    if runs:
        claims_md = claims_markdown(claims(runs))
        (out / "claims.md").write_text(claims_md + "\n")
        print(f"\nthe paper's claims against these runs ({out / 'claims.md'}):\n{claims_md}")
    if lr_groups(runs):
        sweep_md = lr_sweep_markdown(runs)
        picked = ", ".join(f"{base}@{lr:g}" for base, lr in best_lrs(runs).items())
        (out / "lr_sweep.md").write_text(sweep_md + f"\n\npicked (highest late training reward): {picked}\n")
        print(f"\nlearning rates ({out / 'lr_sweep.md'}):\n{sweep_md}\npicked: {picked}")
    print(f"\nresults: {out / 'results.json'} ({time.monotonic() - t_start:.0f} s)")
    return 0 if all(o["status"] in ("done", "cached") for o in outcomes) else 1


def job_devices(gpus: str) -> list[str] | None:
    """--gpus -> the CUDA device ids jobs are spread over, or None (one device or none: nothing to spread)."""
    if gpus == "none":
        return None
    if gpus == "auto":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",")][:count] if visible else [str(i) for i in range(count)]
        return ids if len(ids) > 1 else None
    ids = [d.strip() for d in gpus.split(",") if d.strip()]
    if not ids or len(set(ids)) != len(ids):
        raise StudyError(f"--gpus {gpus!r}: expected auto, none or distinct device ids, e.g. 0,1")
    return ids


def default_test(train: str) -> str:
    """The held-out source when --test is not given: the held-out part of a split source, else DEFAULT_TEST."""
    return HELDOUT_OF.get(train, DEFAULT_TEST)


def overlap_check(train: str, test: str, eval_limit: int, seed: int) -> dict | None:
    """Print, once before the jobs, the contamination warning for the two sources' names and the word
    overlap of the held-out questions with the training ones (qerl.data.overlap); the summary, or None when
    a source could not be read here (hub sources are not downloaded for it)."""
    from ..data import DatasetError, load_problems
    from ..data.datasets import HUB, contamination_warning
    from ..data.overlap import format_summary, max_overlap

    warning = contamination_warning(train, test)
    if warning:
        print(f"warning: {warning}")
    if train.partition(":")[0] in HUB or test.partition(":")[0] in HUB:
        print("overlap check: skipped (hub source)")
        return None
    try:
        train_q = [r["question"] for r in load_problems(train, split="train", seed=seed)]
        test_q = [r["question"] for r in load_problems(test, split="test", limit=eval_limit, seed=0)]
    except (DatasetError, OSError) as e:
        print(f"overlap check: skipped ({e})")
        return None
    result = max_overlap(test_q, train_q)
    print(f"overlap check ({test} vs {train}): {format_summary(result, test_q, train_q, top=3)}")
    return {"train": train, "test": test, **result.summary(top=5)}


def _check_configs(args, jobs: list[Job]) -> dict:
    """Build every job's config now, and look for data files: a bad --set, config or path fails here, not
    in N subprocesses. Returns {job: its comparable_config}."""
    from ..config import ConfigError, load_config

    for flag, source in (("--train", args.train), ("--test", args.test)):
        if Path(source).suffix.lower() in (".jsonl", ".json", ".parquet") and not Path(source).is_file():
            raise StudyError(f"{flag} {source}: no such file")
    configs = {}
    for job in jobs:
        try:
            configs[job] = comparable_config(load_config(args.config, job_overrides(args, job)))
        except ConfigError as e:
            raise StudyError(f"{job.name}: {e}") from None
    return configs
