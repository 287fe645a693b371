"""Reward worker process: `python -m qerl.rewards.worker READ_FD WRITE_FD`.

Started by `RewardRunner` as a plain subprocess (not multiprocessing's spawn, which would re-import the
user's `__main__` -- re-running a training script without a main guard). It receives pickled
(func, prompts, completions, columns) on READ_FD and answers ("ok", values) or ("error", message) on
WRITE_FD; its own stdout/stderr stay the user's (a reward function may print). The first message is the
parent's sys.path, so functions from the user's modules unpickle here, and the module of the function it
serves, imported before the worker reports ready (a slow import is not charged to the first call's timeout).
"""

import importlib
import pickle
import signal
import sys
from multiprocessing.connection import Connection


def as_values(result):
    """A reward function's result as a list when it is a sequence of values (list, tuple, array, generator);
    a string or a lone number is passed on as it is, for `check_values` to name ("1.0" is not three values)."""
    if isinstance(result, (str, bytes, int, float)) or not hasattr(result, "__iter__"):
        return result
    return list(result)


def warm_up() -> None:
    """Import and exercise math-verify once (sympy, the LaTeX parser) so that the first scored batch is
    not charged for it against the runner's timeout."""
    try:
        from math_verify import parse, verify

        verify(parse("\\boxed{1}"), parse("#### 1"))
    except Exception:
        pass


def import_quietly(module: str | None) -> None:
    """Import the reward function's module now; if that fails, the call reports the error."""
    if module:
        try:
            importlib.import_module(module)
        except BaseException:
            pass


def serve(inbox: Connection, outbox: Connection) -> None:
    sys.path[:], module = inbox.recv()
    import_quietly(module)
    warm_up()
    outbox.send(("ready", None))
    while True:
        try:
            payload = inbox.recv_bytes()
        except EOFError:
            return
        try:
            func, prompts, completions, columns = pickle.loads(payload)
            result = ("ok", as_values(func(prompts, completions, **columns)))
        except BaseException as e:  # report everything: the parent decides what to count
            result = ("error", f"{type(e).__name__}: {e}")
        try:
            outbox.send(result)
        except Exception as e:  # an unpicklable return value
            outbox.send(("error", f"result could not be sent back: {type(e).__name__}: {e}"))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


if __name__ == "__main__":
    main()
