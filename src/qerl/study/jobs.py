"""Run study jobs as subprocesses, at most N at a time, under a deadline; the CUDA MPS daemon around them.

A job is anything with `name`, `dir`, `log_path` and `result_path` (`study.Job`); it is done when its process
exits 0 and its result.json exists.
"""

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path


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
    trainer would first finish its step, which can outlast the caller's time limit; a resumed job continues
    from its last periodic checkpoint instead."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_jobs(jobs: list, command, parallel: int = 1, deadline: float | None = None, env: dict | None = None,
             poll_s: float = 0.2, log=print, resume: bool = False, devices: list[str] | None = None) -> list[dict]:
    """Run `command(job)` (an argv list) for every job, at most `parallel` at a time; return one outcome
    per job, in order: {"job", "status" (done | failed | killed | not run), "wall_s", "error", "log_tail"}.

    deadline: a time.monotonic() value. Jobs are not started after it (nor, without `resume`, when the median
    duration of the jobs finished so far says they could not end by then), and jobs still running at it are
    killed, so the caller can still write its aggregate inside a hard time limit. A job counts as done when
    it exits 0 and its result.json exists; its output goes to job.log in its directory. A stale directory (a
    job killed or failed earlier, no result.json) is cleared first, unless `resume`: then it is kept (the job
    continues from its last checkpoint) and job.log is appended to.
    devices: CUDA device ids; each job starts with CUDA_VISIBLE_DEVICES set to the one running the fewest jobs.
    """
    pending, running, outcomes, durations = list(jobs), {}, {}, []
    load = {d: 0 for d in devices or []}

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
            # a resumed job keeps what it did before the deadline, so starting one late still makes progress
            expected = statistics.median(durations) if durations and not resume else 0.0
            too_late = deadline is not None and now + expected > deadline
            while pending and len(running) < parallel and not too_late:
                job = pending.pop(0)
                if job.dir.exists() and not resume:
                    shutil.rmtree(job.dir)
                job.dir.mkdir(parents=True, exist_ok=True)
                job_env, device = env, None
                if load:
                    device = min(load, key=load.get)
                    load[device] += 1
                    job_env = {**(env if env is not None else os.environ), "CUDA_VISIBLE_DEVICES": device}
                with open(job.log_path, "a" if resume else "w") as logf:  # the child keeps its own descriptor
                    proc = subprocess.Popen(command(job), stdout=logf, stderr=subprocess.STDOUT, env=job_env,
                                            start_new_session=True)
                running[job] = (proc, time.monotonic(), device)
                where = f" on GPU {device}" if device is not None else ""
                log(f"[start] {job.name}{where} ({len(running)} running, {len(pending)} waiting)")
            for job, (proc, started, device) in list(running.items()):
                if proc.poll() is not None:
                    del running[job]
                    if device is not None:
                        load[device] -= 1
                    finish(job, proc, started)
            if deadline is not None and time.monotonic() >= deadline:
                for job, (proc, started, _) in list(running.items()):
                    _kill(proc)
                    finish(job, proc, started, "killed")
                running.clear()
            if too_late or (deadline is not None and time.monotonic() >= deadline):
                if not running:
                    break
            time.sleep(poll_s)
    finally:  # an exception or Ctrl-C in the coordinator must not leave orphaned GPU processes behind
        for proc, _, _ in running.values():
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
