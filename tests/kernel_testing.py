"""Shared by the kernel tests: run a test module's checks under the Triton interpreter, and skip on no CUDA."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch


def run_interpreter_suite(module: str, function: str = "interpreter_suite", timeout: int = 900) -> list[str]:
    """Call tests/<module>.<function>() in a fresh interpreter with TRITON_INTERPRET=1 (Triton reads it when
    kernels are built, so it cannot be switched on inside a pytest process that already imported them);
    returns its list of failure messages."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    code = (f"import sys, json; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import {module} as t; print('RESULT' + json.dumps(t.{function}()))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT"):])


def poisoned(fn):
    """Run fn with every buffer the kernels write filled with NaN first (`workspace.poisoned_outputs`), so an
    element a kernel forgets to write fails the check instead of passing as leftover memory."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from qerl.kernels.workspace import poisoned_outputs

        with poisoned_outputs():
            return fn(*args, **kwargs)
    return wrapper


def require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
