"""Write a directory all-or-nothing: fill a hidden temp sibling, fsync, then rename into place."""

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _fsync_tree(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def atomic_directory(out, overwrite: bool = False):
    """Yield a temp directory; on success it becomes `out`, on any error it is deleted and `out` untouched."""
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (pass overwrite=True / --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield tmp
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
