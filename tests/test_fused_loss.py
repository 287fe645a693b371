"""optim.fused_loss (qerl.rl.fused_loss): the update's decoder layers as torch.compile regions.

On the CPU the compiled graphs run through the `aot_eager` backend: the same Dynamo graphs and AOTAutograd
forward / backward split as `inductor`, without generating C++ (a CPU inductor compile of the layer's graphs costs
more than this whole file's budget). What is checked: policy updates agree with the eager reference in fp32
(the same arithmetic, so to rounding); the quantized product and the norms do not break graphs (the packed
attention does, by design); the compiled graphs are reused across layers and across micro-batch lengths;
the custom op passes torch.library's own checks (fake implementation, autograd registration)."""

from contextlib import nullcontext

import pytest
import torch
from test_packing import GROUPS, T, _experience, assert_rel_close, make_batch
from test_recompute import LAYERS, policy, stream_forward
from torch._dynamo.testing import CompileCounterWithBackend

from qerl.config import load_config
from qerl.kernels import dequantized_weights
from qerl.models import lora_parameters
from qerl.nn import QuantLinear
from qerl.nn.noisy_norm import NoisyNorms
from qerl.nn.packed_attention import packed_attention, packed_attention_forward
from qerl.nn.quant_linear_op import policy_key, quantized_matmul
from qerl.kernels.route import KernelPolicy
from qerl.rl.fused_loss import compiled_layers, decoder_layers, plain_forward
from qerl.rl.losses import LossSettings
from qerl.rl.recompute import checkpointable_layers, set_checkpointed
from qerl.rl.update import UpdateSettings, policy_update

BACKEND = "aot_eager"


def _update(model, exp, fused, sigma: float = 0.0, num_updates: int = 2, backend=BACKEND):
    """`num_updates` optimizer steps (2: with the old log-prob pass), KL to the reference, TIS, packed micro-batches
    cut across groups; AQN noise of `sigma` in the norms (the same draw for every call: seed 0). Returns the stats,
    the LoRA gradients and parameters after it."""
    s = UpdateSettings(LossSettings("grpo", 0.2, 0.28, 0.05, T), num_updates=num_updates, max_grad_norm=1e9,
                       max_tokens_per_micro_batch=20, fused_loss=fused, fused_loss_backend=backend)
    params = lora_parameters(model)
    opt = torch.optim.SGD(params.values(), lr=0.5)
    with NoisyNorms(model, sigma, seed=0):
        stats = policy_update(model, exp, opt, list(params.values()), s)
    return (stats, {k: v.grad.clone() for k, v in params.items()},
            {k: v.detach().clone() for k, v in params.items()})


def _assert_same_update(got_update, ref_update):
    (ref, ref_g, ref_p), (got, got_g, got_p) = ref_update, got_update
    for k in ("loss", "kl", "ratio_mean", "clip_fraction", "tis_weight_mean", "grad_norm"):
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-8), k
    assert ref["kl"] > 0
    for k in ref_g:
        assert ref_g[k].abs().max() > 0, k
        assert_rel_close(got_g[k], ref_g[k], what=k)
        assert_rel_close(got_p[k], ref_p[k], rel=1e-6, what=k)


def _policy(fmt, arch="llama"):
    """Three layers: layer 0 recomputes in the backward (checkpointing around a compiled layer), 1 and 2 stay plain."""
    model = policy(arch, fmt=fmt)
    set_checkpointed(checkpointable_layers(model), 2)
    return model


def test_the_fused_update_equals_the_eager_one_bf16():
    """bf16 base + LoRA (Qwen2: biased q, k, v): two optimizer steps, so the reference, old log-prob and loss
    passes all run compiled."""
    exp = _experience(make_batch(seed=4))
    ref = _update(_policy("bf16", "qwen2"), exp, fused=False)
    model = _policy("bf16", "qwen2")
    _assert_same_update(_update(model, exp, fused=True), ref)
    assert not any("forward" in vars(layer) for layer in decoder_layers(model))  # the layers are eager again


def test_two_fused_nvfp4_aqn_updates_equal_the_eager_ones_without_recompiling():
    """NVFP4 + LoRA + AQN: two policy updates in a row on different batches (so micro-batches of other lengths),
    each compared with the eager one. The second compiles nothing. The first compiles 12 frames: five per variant
    (the loss pass with its backward; the reference pass: no grad, LoRA off), each once for every layer and length,
    and two more for layer 0's loss pass, whose input (the frozen embedding's output) needs no gradient (the same
    counts on transformers 5.17 and 5.24)."""
    exps = [_experience(make_batch(seed=4)), _experience(make_batch(seed=5, groups=GROUPS[::-1]))]
    eager, fused = _policy("nvfp4"), _policy("nvfp4")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(BACKEND)
    frames = []
    for exp in exps:
        ref = _update(eager, exp, False, sigma=0.05, num_updates=1)
        _assert_same_update(_update(fused, exp, True, sigma=0.05, num_updates=1, backend=counter), ref)
        frames.append(counter.frame_count)
    assert frames == [12, 12], frames


def _layer_call(model):
    """(layer 0, its args, its kwargs) as the packed loss pass calls it."""
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    layer = decoder_layers(model)[0]
    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad(), dequantized_weights():
        stream_forward(model)(24)
    handle.remove()
    return layer, *seen["call"]


def test_one_decoder_layer_breaks_only_at_the_packed_attention():
    """Dynamo's account of one layer call. Under the packed attention: the one break, reported three times as it
    bubbles up through the frames above it (transformers 5.17 and 5.24 alike), each at the packed attention; the layer becomes four graphs (input norm | q, k, v, RoPE | o_proj | residual, norm, MLP,
    residual). Under transformers' SDPA (the padded path): one graph, no break. Either way the seven quantized
    products are the custom op, none a break. Qwen3: its q / k norms are traced too."""
    model = policy("qwen3")
    layer, args, kwargs = _layer_call(model)
    for packed, graphs, breaks in ((True, 4, 3), (False, 1, 0)):
        torch._dynamo.reset()
        scope = packed_attention(model) if packed else nullcontext()
        with dequantized_weights(), scope:
            out = torch._dynamo.explain(plain_forward(type(layer)))(layer, *args, **kwargs)
        assert (out.graph_count, out.graph_break_count) == (graphs, breaks), packed
        assert all("packed_attention_forward" in str(r.reason) for r in out.break_reasons), out.break_reasons
        ops = [n.target for g in out.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert sum(op is torch.ops.qerl.quantized_matmul.default for op in ops) == 7


def test_the_scope_restores_the_layers_and_pins_the_routing():
    model = policy()
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    linears[0].routing_policy = KernelPolicy(fused_max_m=3)
    with compiled_layers(model, BACKEND) as layers:
        assert len(layers) == LAYERS and all("forward" in vars(layer) for layer in layers)
        assert linears[0].fused_policy_key == policy_key(KernelPolicy(fused_max_m=3))
        assert all(q.fused_policy_key == policy_key(KernelPolicy()) for q in linears[1:])
    assert not any("forward" in vars(layer) for layer in layers)
    assert not any(hasattr(q, "fused_policy_key") for q in linears)
    assert policy_key(None) == -1 and policy_key(KernelPolicy()) == policy_key(KernelPolicy())


@pytest.mark.parametrize("lora", [False, True])
def test_the_custom_op_passes_torch_library_checks(lora):
    """opcheck: the fake implementation's shapes / dtypes / strides match the real one, the autograd registration
    gives the gradients the real op's backward does, and the op survives torch.compile's tracing."""
    layer = next(m for m in policy().modules() if isinstance(m, QuantLinear))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, layer.in_features, generator=g, requires_grad=True)
    h = b = None
    if lora:
        h = torch.randn(5, 4, generator=g, requires_grad=True)
        b = torch.randn(layer.out_features, 4, generator=g, requires_grad=True)
    args = (x, list(layer.quantized_tensors().values()), layer.bias, h, b, layer.weight_format,
            ",".join(layer._tensor_names), layer.out_features, -1)
    # test_schema is left out: it perturbs every input with a float mul, which FP8 block scales do not support
    torch.library.opcheck(quantized_matmul, args,
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_the_custom_op_gives_the_eager_functions_gradients():
    """The op's registered backward against the eager QuantLinear's autograd.Function, LoRA on."""
    layer = next(m for m in policy().modules() if isinstance(m, QuantLinear))
    x = torch.randn(2, 7, layer.in_features, generator=torch.Generator().manual_seed(1))
    grads = []
    for compiled in (False, True):
        xi = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        if compiled:
            y = torch.compile(layer, backend=BACKEND, fullgraph=True)(xi)  # fullgraph: any break would raise
        else:
            y = layer(xi)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grads.append((y.detach(), xi.grad, layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone()))
    for ref, got in zip(*grads):
        assert_rel_close(got, ref, rel=1e-6)


def test_the_config_key():
    assert load_config(None, []).optim.fused_loss is False
    assert load_config(None, ["optim.fused_loss=true"]).optim.fused_loss is True
    from qerl.rl.checkpointing import FUTURE_ONLY_KEYS
    from qerl.rl.settings import update_settings

    assert update_settings(load_config(None, ["optim.fused_loss=true"])).fused_loss is True
    assert "optim.fused_loss" in FUTURE_ONLY_KEYS  # time, not the math: a resumed run may switch it


def test_the_packed_attention_stays_eager_code():
    """The registered packed attention is the plain function behind torch.compiler.disable (same numbers)."""
    from transformers import AttentionInterface

    registered = AttentionInterface._global_mapping["qerl_packed"]
    assert registered is not packed_attention_forward
    assert getattr(registered, "__wrapped__", None) is packed_attention_forward
