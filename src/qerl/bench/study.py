"""`qerl bench study`: the study runner, which lives in `qerl.study` (this module is the command's entry)."""

from ..study import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m qerl.bench.study"))
