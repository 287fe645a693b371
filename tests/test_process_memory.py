"""What a process may use of its GPU (`qerl.rollout.memory.process_memory`): the device's free and total bytes, or
under torch's per-process cap that share of the card, less what this process has reserved; and the two users of
it, the engine's cache sizing and the recompute plan's budget, see the cap. CUDA's counters are stood in for."""

import pytest
import torch

from qerl.rl import recompute
from qerl.rollout import memory

GIB = 2**30
DEVICE = torch.device("cuda", 0)


@pytest.fixture
def card(monkeypatch):
    """An 80 GiB card with 50 GiB free to the device; this process has reserved 10 GiB and allocated 6."""
    state = {"fraction": 1.0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"],
                        raising=False)
    return state


def test_without_a_cap_the_device_is_the_process(card):
    assert memory.process_memory(DEVICE) == (50 * GIB, 80 * GIB)
    assert memory.free_bytes(DEVICE, None) == 54 * GIB  # free + reserved - allocated


def test_a_cap_bounds_total_and_free(card):
    card["fraction"] = 0.25  # 20 GiB: 10 reserved already, so 10 left, though the device has 50 free
    assert memory.process_memory(DEVICE) == (10 * GIB, 20 * GIB)
    assert memory.free_bytes(DEVICE, None) == 14 * GIB
    card["fraction"] = 0.1  # 8 GiB: below what is reserved, nothing left to take
    assert memory.process_memory(DEVICE) == (0, int(0.1 * 80 * GIB))


def test_the_device_free_bytes_still_bound_a_loose_cap(card):
    card["fraction"] = 0.9  # 72 GiB cap, 62 left under it, but other processes hold all but 50
    assert memory.process_memory(DEVICE) == (50 * GIB, int(0.9 * 80 * GIB))


def test_the_recompute_budget_and_the_engine_policy_see_the_cap(card, monkeypatch):
    uncapped = recompute.update_budget(DEVICE, recompute.CAP)
    card["fraction"] = 0.25
    capped = recompute.update_budget(DEVICE, recompute.CAP)
    assert capped == int(recompute.CAP * 20 * GIB) - 6 * GIB - recompute.MARGIN_BYTES
    assert uncapped > capped
    policy = memory.EngineMemoryPolicy(None, DEVICE)
    policy.engine_bytes = 4 * GIB
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 10 * GIB)
    policy.after_update()
    assert policy.keep is True  # 14 GiB <= 0.7 x 20 GiB
    policy.keep, policy.engine_bytes = False, 5 * GIB
    policy.after_update()
    assert policy.keep is False  # 15 GiB > 0.7 x 20 GiB: kept on the whole card, not in this share


def test_an_allocator_without_the_setting_means_no_cap(monkeypatch):
    def refuse(device=None):
        raise RuntimeError("not supported by this allocator")

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", refuse, raising=False)
    assert memory.process_fraction(DEVICE) == 1.0
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    assert memory.process_fraction(DEVICE) == 1.0


@pytest.mark.gpu
def test_a_per_process_cap_is_read_back_and_enforced_on_a_real_gpu():
    """What a study job sharing a GPU does first (`torch.cuda.set_per_process_memory_fraction`, in run_job):
    process_memory reads the cap back on this torch, and torch's allocator refuses past it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from qerl.rollout.memory import process_memory
        device = torch.device("cuda", 0)
        torch.cuda.set_per_process_memory_fraction(0.25, device)
        free, total = process_memory(device)
        card = torch.cuda.mem_get_info(device)[1]
        print(round(total / card, 3), free <= total)
        try:
            torch.empty(int(0.3 * card), dtype=torch.uint8, device=device)
            print("allocated past the cap")
        except torch.OutOfMemoryError:
            print("refused")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.25", "True", "refused"], done.stdout
