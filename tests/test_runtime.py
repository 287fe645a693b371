"""rl/runtime.build_runtime: what an RL step runs on besides the model, built from the config's keys as the trainer
and `qerl bench step` need it (routing, dense weight store, engine, its memory policy, recompute plan)."""

import contextlib

import torch

from qerl.kernels.route import current_policy
from qerl.models import Quantization
from qerl.models.random_weights import random_policy
from qerl.nn import LoraConfig, QuantLinear
from qerl.rl.runtime import build_runtime

from test_bench_step import TINY
from transformers import Qwen2Config


def _model():
    return random_policy(Qwen2Config(**TINY), Quantization.of("nvfp4", lora=LoraConfig(r=4, alpha=8)),
                         torch.device("cpu"))


def test_defaults_hold_no_routing_and_no_store():
    model = _model()
    rt = build_runtime(model, max_seq_len=32)
    assert rt.routing is None and rt.dense_store is None and rt.engine.dense_weights is None
    assert rt.engine.max_seq_len == 32 and rt.recompute.memory is rt.engine_memory
    assert all(m.routing_policy is None for m in model.modules() if isinstance(m, QuantLinear))
    assert isinstance(rt.kernel_routing(), contextlib.nullcontext)


def test_dense_weights_and_compute_as_the_config_asks():
    model = _model()
    rt = build_runtime(model, max_seq_len=32, dense_weights="update", release_kv_cache=True,
                       gradient_checkpointing=True)
    assert rt.dense_store == {} and rt.engine.dense_weights is None and rt.engine_memory.keep is False
    rt = build_runtime(model, max_seq_len=32, dense_weights="all")
    assert rt.engine.dense_weights is rt.dense_store and rt.routing is None
    rt = build_runtime(model, max_seq_len=32, compute="fp8", grad_input_no_temporary=True)
    assert (rt.routing.compute, rt.routing.grad_input_no_temporary) == ("fp8", True)
    assert all(m.routing_policy is rt.routing for m in model.modules() if isinstance(m, QuantLinear))
    with rt.kernel_routing():
        assert current_policy().compute == "fp8"
    assert current_policy().compute == "bf16"
