"""`python -m qerl.study`: the study command (`qerl bench study`)."""

from .runner import main

raise SystemExit(main(prog="python -m qerl.study"))
