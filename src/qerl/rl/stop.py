"""How a run or a command stops early: on a signal (SIGINT / SIGTERM) or on a condition training must not go
past. Light on purpose: the CLI imports it before anything heavy, so that a Ctrl-C during the imports or the
model load also ends with one line."""

import signal
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingAborted(RuntimeError):
    """Too many bad steps in a row, a reward that always fails, or out of memory; the message says what happened
    and what to change."""


class TrainingInterrupted(RuntimeError):
    """SIGINT / SIGTERM: the step in flight was finished and a checkpoint written."""

    def __init__(self, signum: int, checkpoint: Path):
        super().__init__(f"stopped by {signal.Signals(signum).name} after a checkpoint at {checkpoint}; "
                         "continue with --resume")
        self.signum = signum


class Interrupted(KeyboardInterrupt):
    """A stop signal that ends the work in flight at once; every output being written is discarded (outputs are
    written to temp paths and renamed only when complete)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupt(signum, frame=None):
    """Signal handler: raise Interrupted once; later signals are ignored so the clean-up in flight (deleting a
    half-written temp directory) finishes instead of ending in a traceback."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def raise_on_stop_signals() -> None:
    """SIGINT and SIGTERM raise Interrupted in the main thread (SIGTERM would otherwise kill the process
    without any clean-up)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, interrupt)


class StopRequests:
    """Turn SIGINT/SIGTERM into a request honoured at the next step boundary; a second one aborts at once."""

    def __init__(self, console):
        self.console, self.signum, self._previous = console, None, {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            interrupt(signum)
        self.signum = signum
        self.console.print(f"[yellow]{signal.Signals(signum).name}: finishing this step, then checkpointing "
                           "(send it again to abort now)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
