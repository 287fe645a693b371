"""Run reward functions safely: bounded in time, off the caller's thread, failures counted, never silent.

Each function has the TRL signature `f(prompts, completions, **columns) -> list[float | None]`, with
None meaning "does not apply to this row". `RewardRunner.score` calls every function on the whole batch,
all functions concurrently, each in its own worker:

* a picklable function (module-level function or object, e.g. `math_reward`, not defined in
  `__main__`) runs in a persistent worker subprocess (`qerl.rewards.worker`); if it overruns `timeout_s` the
  process is killed (a hung sympy simplification cannot be interrupted any other way) and a fresh one starts on
  the next call. In the worker the call
  runs on the main thread, so math-verify's own `signal.alarm` timeouts work there too (per item).
* an unpicklable one (lambda, closure) runs in a daemon thread; past `timeout_s` it is abandoned (a
  thread cannot be killed: it may keep using a CPU until it returns) -- pass picklable functions.
* isolation="inline" calls the functions on the caller's thread, with no time bound (debugging).

A function that raises, hangs, returns the wrong length or a non-list, or returns NaN/Inf or a
non-number for a row, gets None for the affected rows; each such row is counted in
`stats["reward_errors/<name>"]` and the first message per function is logged (and kept in
`last_errors`).

Combination: reward[i] = sum over functions with a non-None value of weight_f * value_f[i] (TRL's
nansum). A row where every function gave None has no reward at all; it gets 0.0 and is counted in
`stats["reward/unscored_rows"]` and logged, so a trainer can drop it -- it is never a silent zero.
"""

import logging
import math
import os
import numbers
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable, Sequence

from .worker import as_values

log = logging.getLogger("qerl.rewards")

RewardFunc = Callable[..., list]
STARTUP_TIMEOUT_S = 120.0


def func_name(f) -> str:
    return getattr(f, "__name__", None) or type(f).__name__


class _ProcessWorker:
    """One worker subprocess (`qerl.rewards.worker`) serving one reward function (of `module`, imported
    while the worker starts); replaced after a timeout or a crash."""

    def __init__(self, module: str | None = None):
        self.module = module
        self.proc = None
        self.inbox = self.outbox = None  # our ends: we send on outbox, receive on inbox
        self.ready = False  # the process reported its start-up done

    def launch(self) -> None:
        """Start the process without waiting for it: its start-up (interpreter, the function's module,
        math-verify warm-up: ~1-3 s) runs while the caller goes on (`RewardRunner` launches every worker when it
        is made, so they start together, beside the model loading)."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qerl.rewards.worker", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        os.close(to_child_r), os.close(from_child_w)
        self.outbox = Connection(to_child_w, readable=False)
        self.inbox = Connection(from_child_r, writable=False)
        self.outbox.send((list(sys.path), self.module))
        self.ready = False

    def _await_ready(self) -> None:
        # start-up is not charged to a call's timeout
        if not self.inbox.poll(STARTUP_TIMEOUT_S) or self.inbox.recv()[0] != "ready":
            self.close()
            raise RuntimeError(f"reward worker process did not start within {STARTUP_TIMEOUT_S}s")
        self.ready = True

    def submit(self, payload: bytes) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.launch()
        if not self.ready:
            self._await_ready()
        self.outbox.send_bytes(payload)

    def result(self, deadline: float):
        """("ok", values) | ("error", message) | ("timeout", None); kills the process on timeout."""
        try:
            if self.inbox.poll(max(0.0, deadline - time.monotonic())):
                return self.inbox.recv()
        except (EOFError, OSError) as e:
            self.close()
            return "error", f"worker process died ({type(e).__name__}, exit code {self.proc and self.proc.poll()})"
        self.close()
        return "timeout", None

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=5)
            self.inbox.close(), self.outbox.close()
        self.proc = self.inbox = self.outbox = None
        self.ready = False


class _ThreadCall:
    """One call in a daemon thread; abandoned (not stopped) past its deadline."""

    def __init__(self, func, prompts, completions, columns):
        self.out = None
        self.thread = threading.Thread(target=self._run, args=(func, prompts, completions, columns), daemon=True)
        self.thread.start()

    def _run(self, func, prompts, completions, columns):
        try:
            self.out = ("ok", as_values(func(prompts, completions, **columns)))
        except BaseException as e:
            self.out = ("error", f"{type(e).__name__}: {e}")

    def result(self, deadline: float):
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return ("timeout", None) if self.thread.is_alive() else self.out


def _call_inline(func, prompts, completions, columns):
    try:
        return "ok", as_values(func(prompts, completions, **columns))
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"


def check_values(values, n: int) -> tuple[list[float | None], int, str | None]:
    """Validate one function's output for n rows -> (values with bad entries set to None, number of
    bad rows, first problem). A wrong length or a non-list makes every row bad."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = (f"length {len(values)}" if isinstance(values, (list, tuple))
               else f"a {type(values).__name__} ({values!r:.40})")
        return [None] * n, n, f"returned {got}, expected a list of {n} values"
    out, bad, problem = [], 0, None
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
        elif isinstance(v, numbers.Real) and math.isfinite(float(v)):
            out.append(float(v))
        else:
            out.append(None)
            bad += 1
            problem = problem or f"row {i}: {v!r} is not a finite number or None"
    return out, bad, problem


def _defined_in_main(func) -> bool:
    return getattr(func, "__module__", None) == "__main__" or type(func).__module__ == "__main__"


def _runs_in_a_process(func) -> bool:
    """Whether process isolation can take `func` (picklable, importable by a worker)."""
    if _defined_in_main(func):
        return False
    try:
        pickle.dumps(func)
    except Exception:
        return False
    return True


class RewardRunner:
    """Scores completions with several reward functions; see the module docstring for the semantics.

    funcs: reward functions (TRL signature); weights: one per function (default all 1.0);
    timeout_s: wall-clock bound for one `score` call (all functions run concurrently);
    isolation: "process" (default; picklable functions in killable worker processes, others in
    threads), "thread", or "inline" (no bound).
    """

    def __init__(self, funcs: Sequence[RewardFunc], weights: Sequence[float] | None = None,
                 timeout_s: float = 60.0, isolation: str = "process"):
        if not funcs:
            raise ValueError("RewardRunner needs at least one reward function")
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(funcs):
            raise ValueError(f"{len(funcs)} reward functions but {len(weights)} weights")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite, got {weights}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isolation not in ("process", "thread", "inline"):
            raise ValueError(f"isolation must be 'process', 'thread' or 'inline', got {isolation!r}")
        names = [func_name(f) for f in funcs]
        # duplicate names would merge their stats: suffix them
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        self.funcs, self.weights, self.timeout_s, self.isolation = list(funcs), weights, timeout_s, isolation
        self.workers = [_ProcessWorker(getattr(f, "__module__", None) or type(f).__module__) for f in funcs]
        self.last_errors: dict[str, str] = {}  # name -> first problem of the last `score` call
        self._warned_unpicklable: set[int] = set()
        if isolation == "process":  # all start at once, now: the first `score` waits for the slowest only
            for f, w in zip(funcs, self.workers):
                if _runs_in_a_process(f):
                    try:
                        w.launch()
                    except OSError:  # retried (and reported) by the first call
                        w.close()

    def _start(self, i: int, prompts, completions, columns):
        func = self.funcs[i]
        if self.isolation == "inline":
            return _call_inline(func, prompts, completions, columns)
        if self.isolation == "process":
            try:
                if _defined_in_main(func):
                    # the worker runs no user script, so it cannot import names from __main__
                    raise pickle.PicklingError("defined in __main__")
                payload = pickle.dumps((func, prompts, completions, columns))
            except Exception as e:
                if i not in self._warned_unpicklable:
                    log.warning("reward %s is not picklable (%s); running it in a thread, which cannot be "
                                "stopped if it hangs", self.names[i], e)
                    self._warned_unpicklable.add(i)
            else:
                try:
                    self.workers[i].submit(payload)
                    return self.workers[i]
                except (RuntimeError, OSError) as e:
                    return "error", f"could not start a worker process: {e}"
        return _ThreadCall(func, prompts, completions, columns)

    def score(self, prompts: Sequence, completions: Sequence, columns: dict[str, list] | None = None):
        """Score N completions.

        prompts, completions: N items each; columns: dataset columns, each a list of N values, passed to
        every function as keyword arguments (e.g. answer=[...]).
        Returns (rewards [N] floats, per_func {name: [N] float|None}, stats {str: float}).
        """
        n = len(completions)
        columns = dict(columns or {})
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts but {n} completions")
        for key, col in columns.items():
            if len(col) != n:
                raise ValueError(f"column {key!r} has {len(col)} values for {n} completions")
        prompts, completions = list(prompts), list(completions)
        columns = {k: list(v) for k, v in columns.items()}
        t0 = time.monotonic()
        pending = [self._start(i, prompts, completions, columns) for i in range(len(self.funcs))]
        deadline = time.monotonic() + self.timeout_s
        per_func, stats = {}, {}
        self.last_errors = {}
        for i, p in enumerate(pending):
            name = self.names[i]
            status, values = p if isinstance(p, tuple) else p.result(deadline)
            if status == "ok":
                values, bad, problem = check_values(values, n)
            else:
                problem = f"timed out after {self.timeout_s:g}s" if status == "timeout" else f"raised {values}"
                values, bad = [None] * n, n
            per_func[name] = values
            stats[f"reward_errors/{name}"] = float(bad)
            scored = [v for v in values if v is not None]
            if scored:
                stats[f"reward/{name}"] = sum(scored) / len(scored)
            if problem:
                self.last_errors[name] = problem
                log.warning("reward %s: %d of %d rows failed: %s", name, bad, n, problem)
        rewards, unscored = [], 0
        for row in range(n):
            vals = [(w, per_func[name][row]) for name, w in zip(self.names, self.weights)]
            vals = [w * v for w, v in vals if v is not None]
            unscored += not vals
            rewards.append(sum(vals) if vals else 0.0)
        if unscored:
            log.warning("%d of %d rows have no reward from any function (every value None); they get 0.0",
                        unscored, n)
        stats["reward/unscored_rows"] = float(unscored)
        stats["reward/time_s"] = time.monotonic() - t0
        return rewards, per_func, stats

    def close(self) -> None:
        """Stop the worker processes (they are daemons: they also end with the parent)."""
        for w in self.workers:
            w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
