"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A decode step is a chain of ~13 small launches per layer (norm, LoRA A, the NVFP4 matmuls, RoPE, attention,
SiLU-mul), each a few microseconds, so launch latency and each kernel's first memory round trip are a large
part of the step. With PDL a kernel is launched while the one before it is still running: it issues the
loads that do not depend on its predecessor (the packed weights of the NVFP4 kernels: static for the whole
step), then waits for the predecessor's results (`griddepcontrol.wait`: the previous grid has completed and
its memory is visible) and lets its own successor launch (`griddepcontrol.launch_dependents`).

The contract every kernel with a `PDL` constexpr keeps, when PDL is True:
  - before the wait it only reads memory that no kernel of the step writes (weights, scales, global scale);
  - it writes nothing before the wait (a predecessor may still read the memory it would overwrite);
  - it signals its dependents right after the wait, so at most one grid waits ahead of the running one.
A launch after a kernel without PDL (torch, cuBLAS) is ordered as usual: the wait returns once that kernel
has finished. The flag is on only inside `programmatic_launches` (the rollout engine's decode step), on
CUDA devices of compute capability 9.0 and newer, and never when QERL_PDL=0.
"""

import os
from contextlib import contextmanager

import torch

_ACTIVE = False
_CAPABLE: dict[int, bool] = {}


def supported(device: torch.device) -> bool:
    """PDL needs a CUDA device of compute capability >= 9.0 (and QERL_PDL unset or not "0")."""
    if device.type != "cuda" or os.environ.get("QERL_PDL", "1") == "0":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _CAPABLE[idx]


@contextmanager
def programmatic_launches(device: torch.device, enabled: bool = True):
    """Within this block, kernels of the decode chain on `device` launch with PDL (when `supported`)."""
    global _ACTIVE
    previous = _ACTIVE
    _ACTIVE = enabled and supported(device)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = previous


def active() -> bool:
    return _ACTIVE


def launch_options(x: torch.Tensor) -> dict:
    """Extra launch arguments for a kernel with a `PDL` constexpr whose launch reads or writes x."""
    if _ACTIVE and x.is_cuda:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
