"""What an RL step runs on besides the model and the optimizer, made in one place for `qerl train` and
`qerl bench step`: the kernel routing (model.compute, optim.grad_input_no_temporary), the store of 16-bit weight
copies (model.dense_weights), the rollout engine, its memory policy between rollouts (rollout.release_kv_cache)
and the plan of which decoder layers recompute in the backward (optim.gradient_checkpointing).

    runtime = build_runtime(model, max_seq_len=..., compute=..., dense_weights=..., ...)
    with runtime.kernel_routing():
        rl_step(..., engine=runtime.engine, memory=runtime.engine_memory, dense_store=runtime.dense_store,
                recompute=runtime.recompute)
"""

import contextlib
import dataclasses
from dataclasses import dataclass

from ..rollout.memory import EngineMemoryPolicy
from .recompute import RecomputePlan


@dataclass
class Runtime:
    routing: object | None  # qerl.kernels.route.KernelPolicy the loss pass's layers hold; None: the default routing
    dense_store: dict | None  # model.dense_weights: one store for the loss pass and (with "all") the rollouts
    engine: object  # qerl.rollout.engine.RolloutEngine
    engine_memory: EngineMemoryPolicy
    recompute: RecomputePlan

    def kernel_routing(self):
        """The run's kernel routing as a scope for work done with its engine (the rollouts, an evaluation through
        `engine`): the engine's products read the scope, not the layers."""
        from ..kernels.route import kernel_policy

        return contextlib.nullcontext() if self.routing is None else kernel_policy(self.routing)


def build_runtime(model, tokenizer=None, *, max_seq_len: int, scheduler: str = "continuous", compute: str = "bf16",
                  grad_input_no_temporary: bool | None = None, dense_weights: str = "off",
                  release_kv_cache: bool | None = None, distributed: bool = False,
                  gradient_checkpointing: bool | str = "auto") -> Runtime:
    """The runtime of an RL run on `model` (its config keys: model.compute, optim.grad_input_no_temporary,
    model.dense_weights off | update | all, rollout.release_kv_cache, optim.gradient_checkpointing). A compute
    the device cannot run is refused here (`check_compute`); grad_input_no_temporary None keeps the current
    routing's choice."""
    routing = None
    if grad_input_no_temporary or compute != "bf16":
        from ..kernels.fp8_matmul import check_compute
        from ..kernels.route import current_policy
        from ..nn.quant_linear import set_routing_policy

        check_compute(compute, model.device)
        keep = {} if grad_input_no_temporary is None else {"grad_input_no_temporary": grad_input_no_temporary}
        routing = dataclasses.replace(current_policy(), compute=compute, **keep)
        set_routing_policy(model, routing)
    from ..rollout.engine import RolloutEngine  # looked up at call time (tests stand in for it)

    dense_store = None if dense_weights == "off" else {}
    engine = RolloutEngine(model, tokenizer, max_seq_len=max_seq_len, scheduler=scheduler,
                           dense_weights=dense_store if dense_weights == "all" else None)
    engine_memory = EngineMemoryPolicy(release_kv_cache, model.device, distributed)
    recompute = RecomputePlan(model, gradient_checkpointing, engine_memory)
    return Runtime(routing, dense_store, engine, engine_memory, recompute)
