"""One writer per run directory: an exclusive lock held from before the model loads to the run's end.

Two `qerl train` processes pointed at one output_dir used to interleave their metrics, configs and adapters,
both exiting 0. The lock is an `flock` on `<dir>/.qerl-lock`, which the kernel releases when its process ends
however it ends (exit, exception, SIGKILL), so a lock can never outlive its holder; the file itself stays and
names the last holder's pid, which tells a stale lock (that process is gone: taken over, saying so) from a
live one (refused at once, naming the pid).
"""

import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".qerl-lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class RunLock:
    """`with RunLock(dir, what="output_dir"):` or acquire() / release(). The directory is made when missing
    (and removed again on release when the lock file was all it held, so a refused run leaves nothing)."""

    def __init__(self, directory, what: str = "output_dir"):
        self.directory, self.what = Path(directory).expanduser().resolve(), what
        self.path = self.directory / LOCK_FILE
        self._fd = None
        self._made_dir = False
        self.stale_note = None  # set when a dead process's lock was taken over: the caller may say so

    def acquire(self) -> "RunLock":
        try:  # two runs may start together: exactly one of them makes the directory
            self.directory.mkdir(parents=True)
            self._made_dir = True
        except FileExistsError:
            pass
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = self._holder()
                by = f"process {holder[0]} on {holder[1]}" if holder else "another process"
                raise FileExistsError(f"{self.what} {self.directory}: {by} is writing a run there now (it holds "
                                      f"{self.path}); wait for it to end or choose another {self.what}") from None
            try:  # the holder may have removed the file between our open and our lock: then lock the new one
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = self._holder()
        if previous and previous[1] == socket.gethostname() and previous[0] != os.getpid() \
                and not _pid_alive(previous[0]):
            self.stale_note = (f"{self.path}: taken over from process {previous[0]}, which is no longer running "
                               "(a stale lock of a run that was killed)")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def _holder(self) -> tuple[int, str] | None:
        try:
            pid, host = self.path.read_text().split()[:2]
            return int(pid), host
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self._fd is None:
            return
        try:  # the file goes first: a waiting writer then finds no lock of a live process
            self.path.unlink(missing_ok=True)
            if self._made_dir and not any(self.directory.iterdir()):
                self.directory.rmdir()
        finally:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a Trainer dropped without train() or close(): its fd is no file object
        try:
            self.release()
        except Exception:  # at interpreter exit the modules may be gone; the kernel drops the lock anyway
            pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
