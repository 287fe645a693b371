"""The paper-effects study (docs/results.md): several arms x several seeds of RL on one model, held-out
pass@1 before/after, reward and entropy curves, time split and memory, aggregated as mean and spread over
seeds. `benchmarks/smollm2_rl.py` is the entry point; this module holds the pieces so they can be tested.

An arm is FORMAT[+aqn][:DECAY]: FORMAT a weight format (nvfp4, mxfp4, nf4, bf16), +aqn turns Adaptive
Quantization Noise on, DECAY (exponential, linear, cosine, logarithmic; only with +aqn) is its sigma decay,
exponential when omitted ("nvfp4+aqn:exponential" is the same arm as "nvfp4+aqn"). Every (arm, seed) job
gets the same data, steps and hyper-parameters; the same seed gives the same data order and LoRA
initialisation in every arm.

Each job runs in its own Python process (its own CUDA context; a 135M model leaves one GPU mostly idle, so
--parallel N of them multiply throughput) and writes --out/<arm>_s<seed>/result.json the moment it is done,
next to the trainer's metrics.jsonl and the job's log (job.log). A killed study loses nothing finished:
running the same command again skips every job whose result.json exists (after checking it was made with
the same settings) and runs only the missing ones. To redo a job, delete its directory.
"""

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("nvfp4", "mxfp4", "nf4", "bf16")  # qerl.formats.FORMATS, without importing torch here
DECAYS = ("exponential", "linear", "cosine", "logarithmic")  # qerl.rl.aqn.DECAYS
DEFAULT_DECAY = "exponential"

# What the study itself sets per job; --set may not override them (the arm / seed would silently lie).
STUDY_KEYS = ("model.name", "model.format", "aqn.enabled", "aqn.decay", "data.train", "steps", "seed", "output_dir")

# Quantities aggregated over seeds, with their table headers and decimals.
AGGREGATED = (("pass1_before", "pass@1 before", 3), ("pass1_after", "pass@1 after", 3),
              ("reward_first", "reward first", 3), ("reward_last", "reward last", 3),
              ("entropy_first", "entropy first", 3), ("entropy_last", "entropy last", 3),
              ("seconds", "train s", 1), ("time_rollout", "rollout s/step", 2),
              ("time_update", "update s/step", 2), ("memory_gb", "peak GB", 2))


class StudyError(ValueError):
    """A bad arm, seed list or setting; the message says which and what is allowed."""


# arms, seeds, jobs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    format: str
    aqn: bool = False
    decay: str = DEFAULT_DECAY

    @property
    def name(self) -> str:
        """Canonical spelling: the default decay is left out."""
        return self.format + ("+aqn" if self.aqn else "") + (f":{self.decay}" if self.decay != DEFAULT_DECAY else "")

    @property
    def slug(self) -> str:
        """The name as a directory name."""
        return self.name.replace("+", "_").replace(":", "_")

    def overrides(self) -> list[str]:
        return [f"model.format={self.format}", f"aqn.enabled={'true' if self.aqn else 'false'}",
                f"aqn.decay={self.decay}"]


_ARM = re.compile(r"^(?P<format>[a-z0-9]+)(?P<aqn>\+aqn)?(?::(?P<decay>[a-z]+))?$")


def parse_arm(text: str) -> Arm:
    m = _ARM.match(text.strip())
    if not m:
        raise StudyError(f"arm {text!r}: expected FORMAT[+aqn][:DECAY], e.g. nvfp4, nvfp4+aqn, nvfp4+aqn:linear")
    fmt, aqn, decay = m["format"], bool(m["aqn"]), m["decay"]
    if fmt not in FORMATS:
        raise StudyError(f"arm {text!r}: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if decay is not None and not aqn:
        raise StudyError(f"arm {text!r}: a decay only makes sense with AQN; write {fmt}+aqn:{decay}")
    if decay is not None and decay not in DECAYS:
        raise StudyError(f"arm {text!r}: unknown AQN decay {decay!r}; choose one of {', '.join(DECAYS)}")
    return Arm(fmt, aqn, decay or DEFAULT_DECAY)


def parse_arms(text: str) -> list[Arm]:
    arms = [parse_arm(a) for a in text.split(",") if a.strip()]
    if not arms:
        raise StudyError("--arms: no arm given")
    seen = set()
    for arm in arms:
        if arm in seen:
            raise StudyError(f"--arms: {arm.name} is given twice")
        seen.add(arm)
    return arms


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise StudyError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise StudyError(f"--seeds {text!r}: expected distinct non-negative integers, e.g. 0,1,2")
    return seeds


def check_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip()
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


def split_finished(jobs: list[Job], settings: dict) -> tuple[list[Job], list[Job]]:
    """(jobs still to run, jobs whose result.json exists). A finished result made with other settings is
    refused rather than mixed in: the aggregate would silently average different experiments."""
    todo, done = [], []
    for job in jobs:
        if not job.result_path.is_file():
            todo.append(job)
            continue
        saved = load_result(job.result_path).get("settings", {})
        diffs = [f"{k}: {saved.get(k)!r} there, {v!r} now" for k, v in settings.items() if saved.get(k) != v]
        if diffs:
            raise StudyError(f"{job.result_path} was made with other settings ({'; '.join(diffs)}); use another "
                             "--out or delete that directory")
        done.append(job)
    return todo, done


def write_json_atomic(path: Path, data) -> None:
    """Write then rename: a job killed mid-write never leaves a truncated result.json that would count as done."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# running jobs as subprocesses ---------------------------------------------------------------------


def _error_summary(log_path: Path, lines: int = 20) -> tuple[str, str]:
    """(the exception line, or the last line; the last `lines` lines) of a job's log."""
    try:
        text = log_path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "no log", ""
    tail = text[-lines:]
    errors = [t for t in text if re.match(r"^[\w.]+(Error|Exception|Aborted|Interrupted|Interrupt)\b", t)]
    return (errors[-1] if errors else (tail[-1] if tail else "empty log")), "\n".join(tail)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the job's whole process group (it runs in its own session), then reap it. Not SIGTERM: the
    trainer would finish its step and write a checkpoint the study cannot use."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_jobs(jobs: list[Job], command, parallel: int = 1, deadline: float | None = None, env: dict | None = None,
             poll_s: float = 0.2, log=print) -> list[dict]:
    """Run `command(job)` (an argv list) for every job, at most `parallel` at a time; return one outcome
    per job, in order: {"job", "status" (done | failed | killed | not run), "wall_s", "error", "log_tail"}.

    deadline: a time.monotonic() value. Jobs are not started after it (nor when the median duration of the
    jobs finished so far says they could not end by then), and jobs still running at it are killed, so the
    caller can still write its aggregate inside a hard time limit. A job counts as done when it exits 0 and
    its result.json exists; its output goes to job.log in its directory. A stale directory (a job killed
    or failed earlier, no result.json) is cleared first: the trainer refuses to overwrite a run.
    """
    pending, running, outcomes, durations = list(jobs), {}, {}, []

    def finish(job, proc, started, status=None):
        wall = time.monotonic() - started
        if status is None:
            status = "done" if proc.returncode == 0 and job.result_path.is_file() else "failed"
        error, tail = ("", "") if status == "done" else _error_summary(job.log_path)
        if status == "failed" and proc.returncode == 0:
            error = f"exited 0 without writing {job.result_path.name}; {error}"
        if status == "killed":
            error = f"killed at the deadline after {wall:.0f} s"
        if status == "done":
            durations.append(wall)
        outcomes[job] = {"job": job, "status": status, "wall_s": wall, "error": error, "log_tail": tail}
        log(f"[{status}] {job.name} after {wall:.0f} s" + (f": {error}" if error else ""))

    try:
        while pending or running:
            now = time.monotonic()
            expected = statistics.median(durations) if durations else 0.0
            too_late = deadline is not None and now + expected > deadline
            while pending and len(running) < parallel and not too_late:
                job = pending.pop(0)
                if job.dir.exists():
                    shutil.rmtree(job.dir)
                job.dir.mkdir(parents=True)
                with open(job.log_path, "w") as logf:  # the child keeps its own copy of the descriptor
                    proc = subprocess.Popen(command(job), stdout=logf, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
                running[job] = (proc, time.monotonic())
                log(f"[start] {job.name} ({len(running)} running, {len(pending)} waiting)")
            for job, (proc, started) in list(running.items()):
                if proc.poll() is not None:
                    del running[job]
                    finish(job, proc, started)
            if deadline is not None and time.monotonic() >= deadline:
                for job, (proc, started) in list(running.items()):
                    _kill(proc)
                    finish(job, proc, started, "killed")
                running.clear()
            if too_late or (deadline is not None and time.monotonic() >= deadline):
                if not running:
                    break
            time.sleep(poll_s)
    finally:  # an exception or Ctrl-C in the coordinator must not leave orphaned GPU processes behind
        for proc, _ in running.values():
            _kill(proc)
    for job in pending:
        outcomes[job] = {"job": job, "status": "not run", "wall_s": 0.0, "log_tail": "",
                         "error": "not started: the deadline was (about to be) reached"}
    return [outcomes[job] for job in jobs]


class MPSDaemon:
    """Start the CUDA MPS control daemon for the study and stop it after, so kernels of the concurrent jobs
    share the GPU instead of time-slicing it. Best effort: a missing binary or a failed start is reported
    and the study runs without it; a daemon that was already running is left alone."""

    def __init__(self, enabled: bool, log=print):
        self.enabled, self.log, self.started = enabled, log, False

    def __enter__(self):
        if not self.enabled:
            return self
        if shutil.which("nvidia-cuda-mps-control") is None:
            self.log("--mps: nvidia-cuda-mps-control not found; running without MPS")
            return self
        res = subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, text=True)
        self.started = res.returncode == 0
        self.log("MPS daemon started" if self.started else
                 f"--mps: could not start the MPS daemon ({(res.stderr or res.stdout).strip() or res.returncode}); "
                 "running without it")
        return self

    def __exit__(self, *exc):
        if self.started:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, capture_output=True)
            self.log("MPS daemon stopped")


# one job, in its own process ----------------------------------------------------------------------


def settings_of(args) -> dict:
    """Everything besides arm and seed that defines a job's result (checked when skipping finished jobs)."""
    return {"model": args.model, "config": args.config, "train": args.train, "test": args.test, "steps": args.steps,
            "eval_limit": args.eval_limit, "eval_n": args.eval_n, "eval_temperature": args.eval_temperature,
            "set": list(args.set)}


def job_overrides(args, job: Job) -> list[str]:
    # the arm's keys come last so that they win; check_overrides keeps --set off them anyway
    return [f"model.name={args.model}", f"data.train={args.train}", f"steps={args.steps}", f"seed={job.seed}",
            f"output_dir={job.dir}", "tensorboard=false", *args.set, *job.arm.overrides()]


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


def run_job(args, job: Job) -> dict:
    """Train one arm with one seed in this process; held-out pass@1 before and after; write result.json."""
    import torch

    from ..config import load_config
    from ..data import load_problems
    from ..eval.evaluate import evaluate
    from ..rl.run_log import read_metrics
    from ..rl.trainer import Trainer
    from ..rollout.sampling import SamplingParams

    t_job = time.perf_counter()
    cfg = load_config(args.config, job_overrides(args, job))
    # the held-out problems are the same for every seed (seed 0), so the spread over seeds is the training's
    test_rows = load_problems(args.test, split="test", limit=args.eval_limit, seed=0)
    trainer = Trainer(cfg)
    sampling = SamplingParams(args.eval_temperature, 0, 0.95)

    def held_out() -> float:
        res = evaluate(trainer.model, trainer.tokenizer, test_rows, n_samples=args.eval_n, sampling=sampling,
                       max_new_tokens=cfg.rollout.max_new_tokens, suffix=cfg.data.suffix, seed=job.seed,
                       engine=trainer.engine, progress=False)
        return res["pass@1"]

    before = held_out()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    after = held_out()
    metrics = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    result = {"arm": job.arm.name, "seed": job.seed, "format": job.arm.format, "aqn": job.arm.aqn,
              "decay": job.arm.decay if job.arm.aqn else None, "pass1_before": before, "pass1_after": after,
              "seconds": seconds, **summarize(metrics), "job_seconds": time.perf_counter() - t_job,
              "device": device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "settings": settings_of(args), "metrics": metrics}
    write_json_atomic(job.result_path, result)
    return result


def job_command(args, job: Job) -> list[str]:
    """The argv that runs `job` alone in a fresh interpreter (`--job`)."""
    cmd = [sys.executable, "-m", "qerl.bench.study", "--job", "--arms", job.arm.name, "--seeds", str(job.seed),
           "--model", args.model, "--config", args.config, "--train", args.train, "--test", args.test,
           "--eval-limit", str(args.eval_limit), "--eval-n", str(args.eval_n),
           "--eval-temperature", str(args.eval_temperature), "--steps", str(args.steps), "--out", str(args.out)]
    for item in args.set:
        cmd += ["--set", item]
    return cmd


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


# aggregation --------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> dict:
    """{"mean", "std" (sample std; None for n < 2), "n"} of the values that are not None."""
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not xs:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None, "n": len(xs)}


def aggregate(runs: list[dict], arms: list[str] | None = None) -> dict:
    """{arm: {"n": runs, "seeds": [...], quantity: mean_std}} over the finished runs, arms in the given order
    (by default the order in which they first appear)."""
    order = arms or list(dict.fromkeys(r["arm"] for r in runs))
    out = {}
    for arm in order:
        rows = [r for r in runs if r["arm"] == arm]
        if not rows:
            continue
        out[arm] = {"n": len(rows), "seeds": [r["seed"] for r in rows],
                    **{key: mean_std([r.get(key) for r in rows]) for key, _, _ in AGGREGATED}}
    return out


def fmt_stat(stat: dict, digits: int) -> str:
    if stat["mean"] is None:
        return "-"
    std = "-" if stat["std"] is None else f"{stat['std']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {std}"


def markdown_table(agg: dict) -> str:
    """The aggregate as a Markdown table, mean ± sample std over seeds ('-' where n < 2)."""
    head = ["arm", "n", *(label for _, label, _ in AGGREGATED)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, row in agg.items():
        cells = [arm, str(row["n"]), *(fmt_stat(row[key], digits) for key, _, digits in AGGREGATED)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(agg: dict, outcomes: list[dict], meta: dict) -> str:
    """Header (model, steps, seeds, device, date, command), the table, then every job that did not finish."""
    lines = [f"{meta['model']}, {meta['steps']} steps, seeds {','.join(map(str, meta['seeds']))}, "
             f"{meta['device']}, {meta['date']}, {meta['parallel']} job(s) at a time"
             + (" (times inflated by concurrency)" if meta["parallel"] > 1 else ""),
             "", f"`{meta['command']}`", "", markdown_table(agg) if agg else "(no finished run)"]
    unfinished = [o for o in outcomes if o["status"] not in ("done", "cached")]
    if unfinished:
        lines += ["", "Not finished:"]
        for o in unfinished:
            lines.append(f"- {o['job'].name}: {o['status']}: {o['error']}")
            if o["status"] == "failed" and o["log_tail"]:
                lines += ["  " + t for t in o["log_tail"].splitlines()[-8:]]
    return "\n".join(lines)


# plots --------------------------------------------------------------------------------------------


def _curves(runs: list[dict], key: str):
    """(steps, [n_runs x n_steps] values) over the steps every run has; None marks a non-finite value."""
    import numpy as np

    n = min(len(r["metrics"]) for r in runs)
    steps = [m["step"] for m in runs[0]["metrics"][:n]]
    values = np.array([[np.nan if m.get(key) is None else m[key] for m in r["metrics"][:n]] for r in runs], float)
    return steps, values


def _plot_curves(ax, runs: list[dict], arms: list[str], key: str, spell=lambda arm: arm) -> None:
    """Mean over seeds per arm, with the min-max band over seeds shaded; spell(arm) is its legend name."""
    import numpy as np

    for arm in arms:
        rows = [r for r in runs if r["arm"] == arm and r.get("metrics")]
        if not rows:
            continue
        steps, values = _curves(rows, key)
        line, = ax.plot(steps, np.nanmean(values, axis=0), label=f"{spell(arm)} (n={len(rows)})")
        if len(rows) > 1:
            ax.fill_between(steps, np.nanmin(values, axis=0), np.nanmax(values, axis=0), color=line.get_color(),
                            alpha=0.2, linewidth=0)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def ablation_arms(arms: list[str]) -> list[str]:
    """The arms of the AQN decay ablation: for every format with >= 2 AQN decays, its AQN arms plus its plain
    arm as the no-noise reference. [] when no format has two decays."""
    parsed = [parse_arm(a) for a in arms]
    formats = [f for f in dict.fromkeys(a.format for a in parsed)
               if len({a.decay for a in parsed if a.format == f and a.aqn}) >= 2]
    return [a.name for a in parsed if a.format in formats]


def plot_study(runs: list[dict], agg: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    arms, written = list(agg), []
    ablation = ablation_arms(arms)
    # the other decays have their own figure; eight overlapping bands in one would hide the main comparison
    main_arms = [a for a in arms if a not in ablation or parse_arm(a).decay == DEFAULT_DECAY]
    band = " (mean over seeds, band: min-max)"
    for key, label in (("reward", "train reward"), ("entropy", "entropy (nats/token)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        _plot_curves(ax, runs, main_arms, key)
        ax.set(xlabel="step", ylabel=label, title=label + band)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / f"study_{key}.png"))

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(arms)), 4.5))
    x, width = np.arange(len(arms)), 0.38
    for i, (key, label) in enumerate((("pass1_before", "before"), ("pass1_after", "after"))):
        means = [agg[a][key]["mean"] or 0.0 for a in arms]
        stds = [agg[a][key]["std"] or 0.0 for a in arms]
        ax.bar(x + (i - 0.5) * width, means, width, yerr=stds, capsize=3, label=label)
    ax.set_xticks(x, [f"{a.replace(':', chr(10) + ':')}\n(n={agg[a]['n']})" for a in arms], fontsize=8)
    ax.set(ylabel="held-out pass@1", title="held-out pass@1 before / after RL (error bars: std over seeds)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    written.append(_save(fig, out / "study_pass1.png"))

    if ablation:
        fig, ax = plt.subplots(figsize=(7, 4))
        decay = {a: parse_arm(a) for a in ablation}  # name the default decay too: it is one of those compared
        _plot_curves(ax, runs, ablation, "reward",
                     lambda a: f"{decay[a].format}+aqn:{decay[a].decay}" if decay[a].aqn else f"{a} (no AQN)")
        ax.set(xlabel="step", ylabel="train reward", title="AQN decay ablation" + band)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "study_ablation_reward.png"))
    return written


# the command --------------------------------------------------------------------------------------


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--config", default="configs/smollm2-demo.yaml")
    p.add_argument("--train", default="reasoning-gym:basic_arithmetic")
    p.add_argument("--test", default="reasoning-gym:basic_arithmetic")
    p.add_argument("--eval-limit", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=4)
    p.add_argument("--eval-temperature", type=float, default=0.6)
    p.add_argument("--arms", default="nvfp4+aqn,nvfp4,bf16", help="FORMAT[+aqn][:DECAY],...")
    p.add_argument("--seeds", "--seed", default="0", help="comma-separated, e.g. 0,1,2: every arm once per seed")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--set", action="append", default=[], help="section.key=value for every job")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--parallel", type=int, default=1, help="jobs run at once, each in its own process")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no job after this many seconds, kill those still running, then aggregate")
    p.add_argument("--mps", action="store_true", help="run the CUDA MPS daemon for the study (if installed)")
    p.add_argument("--job", action="store_true", help="internal: run the single (arm, seed) in this process")
    return p


def main(argv=None, description: str = __doc__, prog: str = "python -m qerl.bench.study") -> int:
    t_start = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(description).parse_args(argv)
    try:
        arms, seeds = parse_arms(args.arms), parse_seeds(args.seeds)
        check_overrides(args.set)
        if args.parallel < 1:
            raise StudyError(f"--parallel must be >= 1, got {args.parallel}")
        jobs = make_jobs(arms, seeds, Path(args.out))
        if args.job:
            if len(jobs) != 1:
                raise StudyError("--job runs exactly one arm and one seed")
            run_job(args, jobs[0])
            return 0
        _check_configs(args, jobs)
        todo, finished = split_finished(jobs, settings_of(args))
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for job in finished:
        print(f"[cached] {job.name}: {job.result_path} exists")
    if args.parallel > 1:
        print(f"note: {args.parallel} jobs share the machine at a time; their wall times (train s, rollout and "
              "update s/step) are inflated relative to solo runs")
    deadline = t_start + args.deadline_s if args.deadline_s is not None else None
    with MPSDaemon(args.mps):
        outcomes = run_jobs(todo, lambda job: job_command(args, job), args.parallel, deadline, job_env(args.parallel))
    outcomes += [{"job": job, "status": "cached", "wall_s": 0.0, "error": "", "log_tail": ""} for job in finished]
    outcomes.sort(key=lambda o: jobs.index(o["job"]))
    runs = [load_result(o["job"].result_path) for o in outcomes if o["status"] in ("done", "cached")]
    agg = aggregate(runs, [a.name for a in arms])
    meta = {"model": args.model, "steps": args.steps, "seeds": seeds, "parallel": args.parallel,
            "device": next((r["device"] for r in runs if r.get("device")), "unknown (no finished run)"),
            "date": time.strftime("%Y-%m-%d"), "command": shlex.join([*shlex.split(prog), *argv])}
    write_json_atomic(out / "results.json", {
        **meta, "mps": args.mps, "args": vars(args), "settings": settings_of(args), "aggregate": agg,
        "jobs": [{"name": o["job"].name, "arm": o["job"].arm.name, "seed": o["job"].seed,
                  **{k: o[k] for k in ("status", "wall_s", "error", "log_tail")}} for o in outcomes],
        "runs": runs})
    if runs:
        for path in plot_study(runs, agg, out):
            print(f"plot: {path}")
    print()
    print(report(agg, outcomes, meta))
    print(f"\nresults: {out / 'results.json'} ({time.monotonic() - t_start:.0f} s)")
    return 0 if all(o["status"] in ("done", "cached") for o in outcomes) else 1


def _check_configs(args, jobs: list[Job]) -> None:
    """Build every job's config now, and look for data files: a bad --set, config or path fails here, not
    in N subprocesses."""
    from ..config import ConfigError, load_config

    for flag, source in (("--train", args.train), ("--test", args.test)):
        if Path(source).suffix.lower() in (".jsonl", ".json", ".parquet") and not Path(source).is_file():
            raise StudyError(f"{flag} {source}: no such file")
    for job in jobs:
        try:
            load_config(args.config, job_overrides(args, job))
        except ConfigError as e:
            raise StudyError(f"{job.name}: {e}") from None


if __name__ == "__main__":
    raise SystemExit(main())
