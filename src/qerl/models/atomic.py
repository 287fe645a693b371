"""Output paths, one rule for every command: checked before any work, written all-or-nothing, and replaced
only when qerl wrote them.

A directory qerl writes (a quantized or merged model, an adapter, a checkpoint) is filled in a hidden temp
sibling, fsynced, then renamed into place; it carries OUTPUT_MARKER, a small JSON file naming what wrote it.
`overwrite` replaces an existing directory only when it holds that marker (or is empty): a directory of the
user's own files is refused with a list of what is in it, never deleted. A file qerl writes (`qerl eval
--out`) is written to a temp sibling and renamed; `overwrite` replaces only a file a `recognise` function
accepts as qerl's own. The results get the permissions of a normal new file or directory (the umask's),
not the temp files' 0600 / 0700.
"""

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

OUTPUT_MARKER = ".qerl-output.json"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_tree(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _normal_permissions(root: Path) -> None:
    """Give `root` and everything in it the umask's permissions: the temp directory is made 0700, and writers
    such as safetensors make their files 0600, which would keep a shared model or adapter from its group."""
    mask = _umask()
    for path in [*root.rglob("*"), root]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def listing(path: Path, limit: int = 5) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_writable(directory: Path, out: Path, what: str) -> None:
    """ValueError naming `what` when no file can be made in the existing `directory` (where `out` will go).
    It is tried, not asked (`os.access`): root passes every permission check, yet /sys and /proc, read-only
    mounts and full quotas refuse the write itself."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".qerl-probe-")
    except OSError as e:
        raise ValueError(f"{what} {out}: cannot write in {directory} ({e.strerror or e}); choose a writable "
                         "path") from None
    os.close(fd)
    os.unlink(name)


def _check_parent(out: Path, what: str) -> None:
    """ValueError when `out`'s parent cannot hold it: a file on the way, or a directory we may not write."""
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {out}: {parent} is a file, not a directory")
    check_writable(parent, out, what)


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def check_apart_from_inputs(out: Path, inputs: dict[str, object], what: str, containing: bool = True) -> None:
    """ValueError when the output `out` is one of the command's inputs ({option: path}), lies inside one, or
    (containing=True: an output that replaces what is there) contains one: writing it would destroy or change
    what the command reads. Inputs that are not local paths (hub ids, embedded model names) are skipped."""
    for option, source in inputs.items():
        if not source or not Path(str(source)).expanduser().exists():
            continue
        path = Path(str(source)).expanduser().resolve()
        if _inside(out, path) or (containing and _inside(path, out)):
            relation = "is" if out == path else "is inside" if _inside(out, path) else "contains"
            raise ValueError(f"{what} {out}: {relation} the input {option} {path}; writing it would destroy or change "
                             f"what the command reads: choose an output path apart from {option}")


def is_qerl_output(path: Path) -> bool:
    """Whether the directory `path` was written by qerl (holds OUTPUT_MARKER)."""
    return (Path(path) / OUTPUT_MARKER).is_file()


def check_output_dir(out, overwrite: bool = False, what: str = "--out",
                     inputs: dict[str, object] | None = None) -> Path:
    """The resolved output directory, checked before any work: ValueError when it is, is inside or contains one of
    the command's `inputs` ({option: path}); FileExistsError when it exists and overwrite is off; ValueError when
    it is a file, when it holds files qerl did not write (even with overwrite), or when its parent cannot be
    written (tried). An empty directory is always fine."""
    out = Path(out).expanduser().resolve()
    check_apart_from_inputs(out, inputs or {}, what)
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"{what} {out}: is a file; give a directory path")
        if any(out.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{what} {out}: already exists (--overwrite replaces a directory qerl wrote)")
            if not is_qerl_output(out):
                raise ValueError(f"{what} {out}: holds files qerl did not write ({listing(out)}); --overwrite "
                                 "replaces only a directory qerl wrote: choose another path or remove it yourself")
    _check_parent(out, what)
    return out


@contextmanager
def atomic_directory(out, overwrite: bool = False, kind: str = "output", check_owner: bool = True):
    """Yield a temp directory; on success it becomes `out` (with OUTPUT_MARKER naming `kind`), on any error or
    interruption it is deleted and `out` untouched. Refusals as `check_output_dir`; check_owner=False lets
    overwrite replace a directory without the marker (qerl's own subdirectories of a run, which older versions
    wrote unmarked)."""
    if check_owner:
        out = check_output_dir(out, overwrite)
    else:
        out = Path(out).expanduser().resolve()
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out}: already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield tmp
        from .. import __version__

        (tmp / OUTPUT_MARKER).write_text(json.dumps({"written_by": f"qerl {__version__}", "kind": kind,
                                                     "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        _normal_permissions(tmp)
        _fsync_tree(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_file(out, overwrite: bool = False, recognise: Callable[[Path], bool] | None = None,
                      what: str = "--out", inputs: dict[str, object] | None = None) -> Path:
    """The resolved output file, checked before any work: ValueError when it is, is inside or contains one of the
    command's `inputs`, is a directory or its parent cannot be written (tried); FileExistsError when it exists
    and overwrite is off; ValueError when it exists and `recognise` does not accept it as qerl's own (an empty
    file always is)."""
    out = Path(out).expanduser().resolve()
    if out.is_dir():
        raise ValueError(f"{what} {out}: is a directory; give a file path")
    check_apart_from_inputs(out, inputs or {}, what)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{what} {out}: already exists (--overwrite replaces a file qerl wrote)")
        if out.stat().st_size and not (recognise is not None and recognise(out)):
            raise ValueError(f"{what} {out}: is not a file qerl wrote; --overwrite replaces only those: choose "
                             "another path or remove it yourself")
    _check_parent(out, what)
    return out


@contextmanager
def atomic_file(out: Path, mode: str = "w"):
    """Yield an open temp file beside `out`; on success it is fsynced and renamed to `out`, on any error or
    interruption deleted (an existing `out` stays as it was)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.tmp-")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(name, 0o666 & ~_umask())
        os.replace(name, out)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
