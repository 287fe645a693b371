"""Expert LoRA (`lora.experts`): per-expert LoRA factors on the 4-bit Qwen3-MoE / Qwen2-MoE experts (CPU, fp32):
the forward equals transformers' experts on merged dense weights, both grouped products (torch._grouped_mm and
the loop) equal the reference path, logits and LoRA gradients equal peft's (`target_parameters`) on the
dequantized base through the saved adapter, lora_disabled, refusals, rollout engine, and a 2-step `qerl train`."""

import copy
import json

import pytest
import torch

from qerl.models import add_lora, load_adapter, lora_parameters, memory_report, quantize_model, save_adapter
from qerl.models.adapter import peft_expert_tensor, peft_name
from qerl.nn import LoraConfig
from qerl.nn.quant_base import lora_disabled
from qerl.nn.quant_experts import QuantExperts, grouped_mm_works, lora_rows_grouped_mm, lora_rows_loop

from tiny_moe import fill_dense_twin, tiny_moe

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

E, H, I = 8, 64, 64  # noqa: E741 -- tiny_moe's experts (moe_intermediate_size 64)
LORA = LoraConfig(r=4, alpha=8, experts=True)


def _randomize(model, seed=1, std=0.1):
    """LoRA B starts at zero: give every LoRA factor (linears and experts) random values so each one matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _quantized(arch="qwen3_moe", fmt="nvfp4", lora=LORA):
    return _randomize(quantize_model(tiny_moe(arch, experts_implementation="eager"), fmt, lora=lora))


def _merged_hf(quant: QuantExperts, arch="qwen3_moe") -> Qwen3MoeExperts:
    """transformers' experts module holding the dequantized base + scaling * B_e @ A_e per expert."""
    from tiny_moe import tiny_moe_config

    ref = Qwen3MoeExperts(tiny_moe_config(arch, experts_implementation="eager")).float()
    with torch.no_grad():
        for name, w in quant.dequantized_hf(torch.float32).items():
            getattr(ref, name).copy_(w + quant.lora_delta(name))
    return ref


def _routing(t=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    index = torch.randint(0, E - 1, (t, 2), generator=g)  # expert E - 1 receives nothing
    index[5, 1] = E  # an expert-parallel sentinel pair, skipped
    return x, index, torch.rand(t, 2, generator=g)


def _plain_linear(quant):
    """The plain-torch grouped base product `grouped_forward` accepts (rows past offsets[-1]: zero)."""
    def linear(x, offsets, weight):
        bounds = offsets.tolist()
        out = x.new_zeros(x.shape[0], quant.weight_dims(weight)[0])
        for e in range(quant.num_experts):
            out[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]] @ quant.dequantized_expert(weight, e, x.dtype).T
        return out
    return linear


def test_shapes_init_scaling_and_trainability():
    model = quantize_model(tiny_moe("qwen3_moe"), "nvfp4", lora=LoraConfig(r=4, alpha=8, use_rslora=True,
                                                                             experts=True))
    quant = model.model.layers[0].mlp.experts
    assert quant.scaling == 8 / 2  # rslora: alpha / sqrt(r), as the dense LoRA
    assert quant.lora_A["gate_up_proj"].shape == (E, 4, H) and quant.lora_B["gate_up_proj"].shape == (E, 2 * I, 4)
    assert quant.lora_A["down_proj"].shape == (E, 4, I) and quant.lora_B["down_proj"].shape == (E, H, 4)
    for p in [*quant.lora_A.values(), *quant.lora_B.values()]:
        assert p.dtype == torch.float32 and p.requires_grad
    assert all(torch.count_nonzero(b) == 0 for b in quant.lora_B.values())  # starts as the base
    a = quant.lora_A["gate_up_proj"]
    bound = 1 / H ** 0.5  # kaiming_uniform(a=sqrt(5)) over fan-in K = H, as each expert's own [r, K] would have
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and not torch.equal(a[0], a[1])
    names = [n for n in lora_parameters(model) if ".experts." in n]
    assert len(names) == 2 * 4  # 2 layers x (A, B) x (gate_up, down)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model))
    per_layer = E * 4 * ((H + 2 * I) + (I + H))  # r (K + N) per expert and weight
    assert memory_report(model)["lora_bytes"] == 4 * (2 * per_layer + sum(
        p.numel() for n, p in lora_parameters(model).items() if ".experts." not in n))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_forward_equals_hf_experts_on_merged_weights(fmt):
    quant = _quantized(fmt=fmt).model.layers[0].mlp.experts
    ref = _merged_hf(quant)
    x, index, weights = _routing()
    with torch.no_grad():
        got, want = quant(x, index, weights), ref(x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with lora_disabled(quant), torch.no_grad():
        plain = quant(x, index, weights)
    assert (got - plain).abs().max() > 1e-2 * want.abs().max()  # the LoRA term is there, and it matters


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_grouped_path_equals_reference(impl, monkeypatch):
    """grouped_forward with a plain-torch base product and the expert LoRA term added over the sorted rows
    (torch._grouped_mm, or the loop it falls back to) equals the reference loop, forward and gradients."""
    import qerl.nn.quant_experts as qe

    if impl == "grouped_mm":  # fp32 on the CPU with 16-byte aligned rows: torch >= 2.9 runs it
        if not hasattr(torch, "_grouped_mm"):
            pytest.skip("this torch has no _grouped_mm")
        assert grouped_mm_works(torch.device("cpu"), torch.float32, 4, H, 2 * I)
    if impl == "loop":
        monkeypatch.setattr(qe, "grouped_mm_works", lambda *a: False)
    quant = _quantized().model.layers[1].mlp.experts
    x, index, weights = _routing(t=40)
    params = [*quant.lora_A.values(), *quant.lora_B.values()]

    def run(forward):
        xx = x.clone().requires_grad_(True)
        out = forward(xx)
        out.square().sum().backward()
        grads = [xx.grad] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out.detach(), grads

    got, got_grads = run(lambda xx: quant.grouped_forward(xx, index, weights, _plain_linear(quant)))
    want, want_grads = run(lambda xx: quant.reference_forward(xx, index, weights))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for g, w in zip(got_grads, want_grads):
        assert w.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


def test_grouped_mm_lora_gives_sentinel_rows_no_output_and_no_gradient(monkeypatch):
    """torch._grouped_mm leaves the rows past the last group undefined, in its output and in its input's
    gradient (uninitialised memory, NaN now and then: a sentinel token's gradient came back NaN in one CPU run).
    Poisoned here with NaN, they must reach neither the output nor x's gradient."""
    if not hasattr(torch, "_grouped_mm") or not grouped_mm_works(torch.device("cpu"), torch.float32, 4, 64, 64):
        pytest.skip("this torch has no CPU _grouped_mm for fp32")
    real_op = torch._grouped_mm

    class Poisoned(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, offs):
            ctx.save_for_backward(a, b, offs)
            out = real_op(a, b, offs=offs).clone()
            out[int(offs[-1]):] = float("nan")
            return out

        @staticmethod
        def backward(ctx, grad):
            a, b, offs = ctx.saved_tensors
            with torch.enable_grad():
                a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
                ga, gb = torch.autograd.grad(real_op(a2, b2, offs=offs), (a2, b2), grad)
            ga = ga.clone()
            ga[int(offs[-1]):] = float("nan")
            return ga, gb, None

    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: Poisoned.apply(a, b, offs))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 64, generator=g, requires_grad=True)
    a, b = torch.randn(3, 4, 64, generator=g), torch.randn(3, 64, 4, generator=g)
    offsets = torch.tensor([0, 3, 7, 10])  # rows 10 and 11: sentinel pairs
    out = lora_rows_grouped_mm(x, offsets, a, b)
    out.square().sum().backward()
    assert torch.equal(out[10:], torch.zeros(2, 64)) and torch.isfinite(out).all()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[10:], torch.zeros(2, 64))
    xr = x.detach().clone().requires_grad_(True)
    lora_rows_loop(xr, offsets, a, b).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("impl", [lora_rows_loop, lora_rows_grouped_mm])
def test_lora_rows_zero_past_the_last_offset(impl):
    if impl is lora_rows_grouped_mm and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    torch.manual_seed(0)
    x, a, b = torch.randn(9, 16), torch.randn(4, 4, 16), torch.randn(4, 8, 4)
    offsets = torch.tensor([0, 2, 2, 5, 7])  # expert 1 empty, rows 7 and 8 are sentinels
    out = impl(x, offsets, a, b)
    for e, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        torch.testing.assert_close(out[lo:hi], x[lo:hi] @ a[e].T @ b[e].T)
    assert torch.equal(out[7:], torch.zeros(2, 8))


def test_lora_disabled_turns_expert_lora_off():
    model = _quantized()
    plain = quantize_model(tiny_moe("qwen3_moe", experts_implementation="eager"), "nvfp4",
                           lora=LoraConfig(r=4, alpha=8))
    with torch.no_grad():  # the same base, and the same attention LoRA, without expert LoRA
        for n, p in lora_parameters(plain).items():
            p.copy_(lora_parameters(model)[n])
    ids = torch.tensor([[1, 20, 30, 40, 50, 60, 7]])
    with torch.no_grad():
        on = model(ids).logits
        with lora_disabled(model):
            off = model(ids).logits
            assert not any(m.lora_active for m in model.modules() if isinstance(m, QuantExperts))
            with lora_disabled(plain):
                torch.testing.assert_close(off, plain(ids).logits, rtol=0, atol=0)
        assert torch.equal(model(ids).logits, on)  # back on after the scope
    assert not torch.allclose(on, off, atol=1e-3)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_logits_and_gradients_equal_peft_through_the_saved_adapter(arch, tmp_path):
    """Issue #33's exactness target: the saved adapter, loaded by peft (`target_parameters`) into the dense HF
    model holding the dequantized base, gives qerl's log-probs, and the LoRA gradients (linears and experts,
    peft's layout mapped back) equal qerl's."""
    from peft import PeftModel

    dense = tiny_moe(arch, experts_implementation="eager")
    reference = copy.deepcopy(dense)
    model = _randomize(quantize_model(dense, "nvfp4", lora=LORA))
    fill_dense_twin(reference, model)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    peft_model = PeftModel.from_pretrained(reference, adapter, is_trainable=True).eval()
    model.eval()

    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(5))
    lp_ours = torch.log_softmax(model(ids).logits, -1)
    lp_theirs = torch.log_softmax(peft_model(ids).logits, -1)
    torch.testing.assert_close(lp_ours, lp_theirs, rtol=1e-5, atol=1e-5)
    lp_ours[..., 7].sum().backward()
    lp_theirs[..., 7].sum().backward()
    theirs = {n.replace("base_model.model.", "", 1).replace(".default.", "."): p
              for n, p in peft_model.named_parameters() if "lora_" in n}
    ours = lora_parameters(model)
    assert sorted(theirs) == sorted(peft_name(n) for n in ours)
    for n, p in ours.items():
        g_ours = peft_expert_tensor(n, p.grad) if ".experts." in n else p.grad
        g_theirs = theirs[peft_name(n)].grad
        assert g_theirs is not None and g_theirs.abs().sum() > 0, n
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-5 * g_theirs.abs().max().item(), msg=n)


def test_save_load_roundtrip(tmp_path):
    model = _quantized("qwen2_moe")
    adapter = save_adapter(model, tmp_path / "adapter")
    fresh = quantize_model(tiny_moe("qwen2_moe", experts_implementation="eager"), "nvfp4",
                           lora=LoraConfig(r=4, alpha=8))
    assert not any(".experts." in n for n in lora_parameters(fresh))
    cfg = load_adapter(fresh, adapter)
    assert cfg.experts
    for n, p in lora_parameters(model).items():
        assert torch.equal(lora_parameters(fresh)[n], p), n
    ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)
    # an adapter without expert LoRA removes it again (load_adapter replaces what is attached)
    add_lora(model, LoraConfig(r=4, alpha=8))
    plain = save_adapter(model, tmp_path / "plain")
    assert not json.loads((plain / "adapter_config.json").read_text()).get("target_parameters")
    load_adapter(fresh, plain)
    assert not any(".experts." in n for n in lora_parameters(fresh))


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="experts: true.*dropout 0"):
        LoraConfig(r=4, dropout=0.1, experts=True)
    from tiny import tiny_model

    with pytest.raises(ValueError, match="lora.experts: .*no 4-bit MoE experts"):
        quantize_model(tiny_model("qwen2"), "nvfp4", lora=LORA)
    with pytest.raises(ValueError, match="lora.experts: .*no 4-bit MoE experts"):  # bf16: experts stay dense
        quantize_model(tiny_moe("qwen3_moe"), "bf16", lora=LORA)
    dense = quantize_model(tiny_model("qwen2"), "nvfp4", lora=LoraConfig(r=4, alpha=8))
    with pytest.raises(ValueError, match="lora.experts: .*no 4-bit MoE experts"):
        add_lora(dense, LORA)
    # an expert adapter cannot load into a model without 4-bit experts
    adapter = save_adapter(_quantized(), tmp_path / "adapter")
    with pytest.raises(ValueError, match="no 4-bit MoE experts"):
        load_adapter(quantize_model(tiny_moe("qwen3_moe"), "nvfp4", lora=LoraConfig(r=4, alpha=8), experts=False),
                     adapter)


def test_gpt_oss_experts_refused():
    from qerl.nn.quant_experts_gpt_oss import GptOssQuantExperts

    model = _quantized()
    layer = model.model.layers[1].mlp.experts
    layer.__class__ = GptOssQuantExperts  # the layout check is by class, before any stack changes
    before = model.model.layers[0].mlp.experts.lora_A["down_proj"]
    with pytest.raises(ValueError, match="Qwen3-MoE / Qwen2-MoE experts layout only.*GptOssQuantExperts"):
        add_lora(model, LORA)
    assert model.model.layers[0].mlp.experts.lora_A["down_proj"] is before
    with pytest.raises(ValueError, match="not supported on gpt-oss experts"):
        GptOssQuantExperts.add_lora(layer, LORA)


def test_config_key():
    from qerl.config import ConfigError, load_config

    assert load_config(None, []).lora.experts is False
    assert load_config(None, ["lora.experts=true", "lora.dropout=0"]).lora.experts is True
    with pytest.raises(ConfigError, match="dropout 0"):
        load_config(None, ["lora.experts=true", "lora.dropout=0.05"])


def test_rollout_engine_sees_expert_lora():
    """The engine runs MoE blocks whole, so its greedy tokens are HF generate's on the model with expert LoRA
    (and that LoRA changes them)."""
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams
    from test_rollout_engine import completions, hf_greedy, prompts_of

    model = _randomize(_quantized(), std=0.3)
    prompts = prompts_of([5, 9], seed=3)
    engine = RolloutEngine(model, max_seq_len=48, check_every=4, cuda_graphs=False)
    got = completions(engine.generate(prompts, 10, SamplingParams(temperature=0), force_lengths=[10, 10]))
    assert got == hf_greedy(model, prompts, 10)
    with lora_disabled(model):
        without = hf_greedy(model, prompts, 10)
    assert got != without


def test_train_moves_the_expert_lora(tmp_path):
    """A 2-step `qerl train` of a tiny Qwen3-MoE checkpoint with lora.experts: the expert factors are trained
    (B leaves zero) and saved; the adapter reloads to the same logits."""
    from qerl.config import load_config
    from qerl.models.policy import build_policy
    from qerl.rl.trainer import Trainer
    from test_train_e2e import _overrides
    from tiny import tiny_tokenizer

    d = tmp_path / "model"
    tiny_moe("qwen3_moe").to(torch.bfloat16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": str(2 * a)}) + "\n" for a in range(8)))
    cfg = load_config(None, _overrides(d, data, tmp_path / "run", steps=2, **{
        "model.device": "cpu", "lora.experts": "true", "optim.lr": 1e-2}))
    trainer = Trainer(cfg)
    model = trainer.model
    experts = [n for n in lora_parameters(model) if ".experts." in n]
    assert len(experts) == 8
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert all(id(lora_parameters(model)[n]) in optimized for n in experts)
    before = {n: lora_parameters(model)[n].detach().clone() for n in experts}
    adapter = trainer.train()
    after = lora_parameters(model)
    moved = [n for n in experts if not torch.equal(before[n], after[n])]
    assert any(".lora_B." in n for n in moved), "no expert LoRA B moved"
    fresh, _ = build_policy(cfg.model, LoraConfig(r=4, alpha=8), torch.device("cpu"))
    load_adapter(fresh, adapter)
    ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_grouped_path_with_expert_lora_matches_reference_bf16(fmt):
    """On CUDA in bf16 the grouped kernel path plus the expert LoRA term (torch._grouped_mm where it works,
    else the loop) is close to the reference loop, forward and gradients (input and LoRA factors); it stays
    capturable exactly when torch._grouped_mm works there."""
    quant = _quantized(fmt=fmt).model.layers[0].mlp.experts.cuda()
    dev = torch.device("cuda")
    probe = torch.zeros(1, H, device=dev, dtype=torch.bfloat16)
    assert quant._grouped_applies(probe)
    works = grouped_mm_works(dev, torch.bfloat16, 4, H, 2 * I) and grouped_mm_works(dev, torch.bfloat16, 4, I, H)
    assert quant.capturable(torch.bfloat16, dev) == works
    T = 200
    g = torch.Generator(device=dev).manual_seed(4)
    index = torch.randint(0, E, (T, 2), device=dev, generator=g)
    weights = torch.rand(T, 2, device=dev, dtype=torch.bfloat16, generator=g)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    params = [*quant.lora_A.values(), *quant.lora_B.values()]

    def run(forward):
        xx = x.clone().requires_grad_(True)
        out = forward(xx)
        out.float().square().sum().backward()
        grads = [xx.grad.float()] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out.float().detach(), grads

    got, got_grads = run(lambda xx: quant(xx, index, weights))
    want, want_grads = run(lambda xx: quant.reference_forward(xx, index, weights))
    assert torch.isfinite(got).all()
    assert (got - want).norm() / want.norm() < 1e-2
    for a, b in zip(got_grads, want_grads):
        assert torch.isfinite(a).all() and (a - b).norm() / b.norm() < 3e-2
