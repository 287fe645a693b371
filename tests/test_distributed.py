"""Data parallelism on the CPU with the gloo backend and 2 processes: the summed per-rank gradients equal the
single-process gradient of the whole batch, and `torchrun ... qerl.cli train` runs end to end."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_worker import fixed_batch, policy_with_adapter, run_update

from qerl.rl.distributed import DistContext

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("algo", ["grpo", "dapo", "dr_grpo"])
def test_two_ranks_update_like_one_process(tmp_path, algo):
    single = run_update(fixed_batch(), algo, DistContext())
    port, out = _free_port(), tmp_path / "rank0.pt"
    procs = [subprocess.Popen([sys.executable, str(HERE / "ddp_worker.py"), str(r), "2", str(port), str(out), algo],
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    parallel = torch.load(out)
    for name, want in single.items():
        torch.testing.assert_close(parallel[name], want, rtol=1e-4, atol=1e-6)
    _, initial = policy_with_adapter()  # the update moved the adapter, so the equality above means something
    assert all(not torch.equal(initial[k], single[k]) for k in single)


def test_torchrun_train_end_to_end(tmp_path):
    import torch.distributed.run  # noqa: F401  (torchrun ships with torch)
    from test_train_e2e import _overrides
    from tiny import tiny_model, tiny_tokenizer

    model_dir = tmp_path / "model"
    tiny_model("qwen2", dtype=torch.bfloat16).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=?", "answer": str(a + b)}) + "\n"
                            for a in range(1, 6) for b in range(1, 6)))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "qerl.cli", "train", *_overrides(model_dir, data, out, steps=2, save_every=1)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]  # one writer
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


def test_phase_timings_do_not_change_the_update():
    """policy_update(timings=...) reports every phase it ran and gives the same update as without."""
    from qerl.rl.losses import LossSettings
    from qerl.rl.update import UpdateSettings, policy_update

    exp = fixed_batch()
    results, timings = [], {}
    for t in (None, timings):
        model, params = policy_with_adapter()
        opt = torch.optim.SGD(params.values(), lr=0.1)
        settings = UpdateSettings(LossSettings("grpo", 0.2, 0.2, 0.04, 6), num_updates=2, micro_batch_size=3,
                                  max_grad_norm=1e9, tis_cap=2.0)
        policy_update(model, exp, opt, list(params.values()), settings, timings=t)
        results.append({k: v.detach().clone() for k, v in params.items()})
    assert set(timings) == {"reference", "old_logprobs", "loss_backward", "optimizer"}
    assert all(v > 0 for v in timings.values())
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k
