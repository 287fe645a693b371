"""`rollout.release_kv_cache`: the engine's KV cache and decode graphs freed after each rollout, kept, or (auto)
kept once the first step showed they fit."""

import pytest
import torch

from qerl.config import load_config
from qerl.rl.trainer import Trainer
from qerl.rollout.memory import EngineMemoryPolicy

from test_train_e2e import _overrides, data_file  # noqa: F401  (a fixture)


@pytest.mark.parametrize("release,freed", [(True, True), (False, False), (None, True)])
def test_policy_on_the_cpu(release, freed):
    """Off CUDA auto frees the engine's cache after every rollout, as true does; false keeps it."""
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams
    from tiny import tiny_model

    engine = RolloutEngine(tiny_model("llama"), max_seq_len=32)
    policy = EngineMemoryPolicy(release, torch.device("cpu"))
    for _ in range(3):
        engine.generate([[5, 6, 7]], 4, SamplingParams(temperature=0), ignore_eos=True)
        assert policy.after_rollout(engine) == freed
        assert (engine.cache is None) == freed
        policy.after_update()


def test_auto_frees_under_data_parallel():
    policy = EngineMemoryPolicy(None, torch.device("cuda", 0), distributed=True)
    assert not policy.auto and not policy.keep


@pytest.mark.gpu
@pytest.mark.parametrize("release", [None, True])
def test_trainer_keeps_the_engine_once_it_fits(tiny_dir, data_file, tmp_path, release):  # noqa: F811
    """On a GPU, auto frees the engine after the first rollout, then keeps its cache and graphs (a tiny model
    fits many times over); true frees them after every rollout."""
    extra = {"model.device": "cuda", "rollout.release_kv_cache": "null" if release is None else "true"}
    trainer = Trainer(load_config(None, _overrides(tiny_dir, data_file, tmp_path / "run", **extra)))
    trainer.train()
    policy = trainer.engine_memory
    if release is None:
        assert policy.auto and policy.keep and policy.engine_bytes > 0
        assert trainer.engine.cache is not None and trainer.engine.graphs
    else:
        assert not policy.keep and trainer.engine.cache is None
