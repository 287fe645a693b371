"""Programmatic dependent launch is asked for only inside `programmatic_launches`, on sm_90+ CUDA devices,
and never with QERL_PDL=0 (the GPU tests in test_rollout_gpu.py check the launches themselves)."""

import torch

from qerl.kernels import pdl


def test_off_outside_the_block_and_on_the_cpu(monkeypatch):
    x = torch.zeros(2)
    assert pdl.launch_options(x) == {"PDL": False}
    with pdl.programmatic_launches(torch.device("cpu")) as on:
        assert not on and not pdl.active()
        assert pdl.launch_options(x) == {"PDL": False}
    monkeypatch.setenv("QERL_PDL", "0")
    assert not pdl.supported(torch.device("cuda", 0))  # decided before touching the device


def test_block_restores_the_previous_state(monkeypatch):
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    with pdl.programmatic_launches(torch.device("cuda")):
        assert pdl.active()
        with pdl.programmatic_launches(torch.device("cuda"), enabled=False):
            assert not pdl.active()
        assert pdl.active()
        assert pdl.launch_options(torch.zeros(1)) == {"PDL": False}  # a CPU tensor never launches with PDL
    assert not pdl.active()
