"""MoE routers (`moe.train_router`) and the load-balancing loss (`moe.aux_loss_coef`), CPU fp32, against
transformers' `load_balancing_loss_func` / `output_router_logits` and peft's `modules_to_save`."""

import json

import pytest
import torch

from qerl.config import ConfigError, load_config
from qerl.models import load_adapter, lora_parameters, quantize_model, save_adapter
from qerl.models.convert import dequantize_model
from qerl.models.policy import build_policy, enable_gradient_checkpointing
from qerl.models.router import original_routers, prepare_routers, router_modules, router_parameters
from qerl.nn import LoraConfig
from qerl.rl.collect import Experience
from qerl.rl.losses import LossSettings
from qerl.rl.router_aux import load_balancing_loss
from qerl.rl.run_log import read_metrics
from qerl.rl.trainer import Trainer
from qerl.rl.update import UpdateSettings, policy_update

from test_train_e2e import _overrides, data_file  # noqa: F401  (a fixture)
from tiny import tiny_tokenizer
from tiny_moe import MOE_ARCHS, tiny_moe

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

IDS = torch.tensor([[1, 20, 30, 40, 50, 60, 70]])


def _policy(arch, seed=0):
    """Tiny MoE, NVFP4 experts and linears, LoRA with non-zero B."""
    model = quantize_model(tiny_moe(arch, seed=seed), "nvfp4", LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    return model


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 9, 8, generator=g, requires_grad=True) for _ in range(3))
    mask = (torch.arange(9)[None] >= torch.tensor([[0], [4]])).long() if masked else None  # row 2 left-padded
    want = load_balancing_loss_func(logits, 8, 2, mask)
    want_grads = torch.autograd.grad(want, logits)
    got = load_balancing_loss(list(logits), 8, 2, mask)
    got_grads = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    if masked:  # padding changes nothing: the same loss as on the real rows alone
        real = tuple(t[mask.reshape(-1).bool()] for t in logits)
        torch.testing.assert_close(got, load_balancing_loss(list(real), 8, 2), rtol=1e-6, atol=1e-7)


def _experience():
    """Two groups (prompts of 4 and 6 tokens, left-padded to 6), G = 3, completions of up to 5 tokens, one
    row without loss tokens; zero advantages, so the only gradient is the aux loss's."""
    g = torch.Generator().manual_seed(3)
    P, T = 6, 5
    pid, pm = [], []
    for lp in (4, 6):
        prompt = torch.randint(3, 150, (lp,), generator=g)
        for _ in range(3):
            pid.append(torch.cat([torch.zeros(P - lp, dtype=torch.long), prompt]))
            pm.append(torch.arange(P) >= P - lp)
    lc = torch.tensor([5, 0, 3, 2, 5, 4])
    cid = torch.randint(3, 150, (6, T), generator=g)
    cm = torch.arange(T)[None] < lc[:, None]
    n = 6
    return Experience(torch.stack(pid), torch.stack(pm), cid, cm, sampling_logp=torch.zeros(n, T),
                      entropies=torch.zeros(n, T), rewards=torch.zeros(n), advantages=torch.zeros(n), lengths=lc,
                      truncated=torch.zeros(n, dtype=torch.bool))


def _hf_aux(model, exp, token_mask):
    """transformers' aux loss over the padded rows' router logits (`output_router_logits=True`), counting the
    tokens of `token_mask` [N, P + T] (the attention always sees the whole prompt and completion)."""
    ids = torch.cat([exp.prompt_ids, exp.completion_ids], 1)
    attn = torch.cat([exp.prompt_mask, exp.completion_mask], 1).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, output_router_logits=True)
    cfg = model.config
    return load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, token_mask.long())


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_update_adds_transformers_aux_loss_over_real_tokens(arch, packing):
    """One micro-batch: `aux_loss` and the routers' gradient equal transformers' on the tokens the forward
    really computes -- padded: prompt + completion masks; packed: each group's prompt once + the loss tokens
    (gradient checkpointing on: the recompute must not record routers twice)."""
    exp = _experience()
    coef = 0.5
    model = _policy(arch)
    prepare_routers(model, trainable=True)
    enable_gradient_checkpointing(model)
    params = [*lora_parameters(model).values(), *router_parameters(model).values()]
    s = UpdateSettings(LossSettings("grpo"), packing=packing, max_tokens_per_micro_batch=1000, micro_batch_size=64,
                       max_grad_norm=1e9, tis_cap=None, aux_loss_coef=coef)
    stats = policy_update(model, exp, torch.optim.SGD(params, lr=0.0), params, s)

    ref = _policy(arch)
    prepare_routers(ref, trainable=True)
    attn = torch.cat([exp.prompt_mask, exp.completion_mask], 1)
    if packing:  # the packed stream: each group's prompt once (its first row with loss tokens), the loss tokens
        prompt = torch.zeros_like(exp.prompt_mask)
        prompt[0], prompt[3] = exp.prompt_mask[0], exp.prompt_mask[3]
        attn = torch.cat([prompt, exp.completion_mask], 1)
    ref.train()
    want = _hf_aux(ref, exp, attn)
    (coef * want).backward()
    assert stats["aux_loss"] == pytest.approx(want.item(), rel=1e-5)
    assert want.item() > 2  # k = 2 is the balanced minimum; this random router is not balanced
    for (name, p), q in zip(router_parameters(model).items(), router_parameters(ref).values()):
        if name.endswith("mlp.gate.weight"):  # (the last shared-expert gate feeds no router: no aux gradient)
            assert p.grad.abs().max() > 0, name
        want_grad = torch.zeros_like(p) if q.grad is None else q.grad  # the update zero-fills untouched grads
        torch.testing.assert_close(p.grad, want_grad, rtol=1e-4, atol=1e-7)


def test_aux_loss_is_weighted_by_micro_batch_tokens():
    """Split into micro-batches, the added loss is the token-weighted mean of their aux losses."""
    exp = _experience()
    model = _policy("qwen3_moe")
    params = list(lora_parameters(model).values())
    s = UpdateSettings(LossSettings("grpo"), packing=False, micro_batch_size=2, max_grad_norm=1e9, tis_cap=None,
                       aux_loss_coef=1.0)
    stats = policy_update(model, exp, torch.optim.SGD(params, lr=0.0), params, s)
    attn = torch.cat([exp.prompt_mask, exp.completion_mask], 1)
    parts, weights = [], []
    for i in range(0, 6, 2):
        sub = Experience(*(getattr(exp, f)[i:i + 2] for f in ("prompt_ids", "prompt_mask", "completion_ids",
                                                              "completion_mask", "sampling_logp", "entropies",
                                                              "rewards", "advantages", "lengths", "truncated")))
        with torch.no_grad():
            parts.append(_hf_aux(model, sub, attn[i:i + 2]).item())
        weights.append(attn[i:i + 2].sum().item())
    want = sum(p * w for p, w in zip(parts, weights)) / sum(weights)
    assert stats["aux_loss"] == pytest.approx(want, rel=1e-5)
    assert stats["loss"] == pytest.approx(want, rel=1e-5)  # zero advantages: the loss is the aux term alone


def test_trained_routers_round_trip_through_the_adapter_and_peft(tmp_path):
    """Qwen2-MoE (router + shared-expert gate): saved as PEFT modules_to_save, reloaded by qerl and by peft on
    the dequantized base with the same logits; an adapter without routers puts the base routing back."""
    peft = pytest.importorskip("peft")
    model = _policy("qwen2_moe")
    base_logits = _logits(model)
    routers = prepare_routers(model, trainable=True)
    assert set(routers) == {f"model.layers.{i}.mlp.{n}.weight" for i in range(2)
                            for n in ("gate", "shared_expert_gate")}
    assert all(p.dtype == torch.float32 and p.requires_grad for p in routers.values())
    torch.testing.assert_close(_logits(model), base_logits, rtol=0, atol=0)  # preparing changes nothing (fp32)
    with torch.no_grad():
        for p in routers.values():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    trained = _logits(model)
    assert not torch.allclose(trained, base_logits, atol=1e-3)
    with original_routers(model):  # the KL reference: base routing, LoRA untouched
        torch.testing.assert_close(_logits(model), base_logits, rtol=0, atol=0)
    torch.testing.assert_close(_logits(model), trained, rtol=0, atol=0)
    out = save_adapter(model, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["modules_to_save"]) == ["mlp.gate", "shared_expert_gate"]

    fresh = _policy("qwen2_moe", seed=0)
    load_adapter(fresh, out)
    assert not any(p.requires_grad for p in router_parameters(fresh).values())  # loaded frozen
    torch.testing.assert_close(_logits(fresh), trained, rtol=1e-6, atol=1e-6)

    dense = dequantize_model(_policy("qwen2_moe"))  # experts stay QuantExperts; peft leaves them alone
    theirs = peft.PeftModel.from_pretrained(dense, str(out))
    torch.testing.assert_close(_logits(theirs), trained, rtol=1e-5, atol=1e-5)

    lora_only = tmp_path / "lora_only"
    plain = _policy("qwen2_moe")
    save_adapter(plain, lora_only)
    assert "modules_to_save" not in json.loads((lora_only / "adapter_config.json").read_text()) or \
        not json.loads((lora_only / "adapter_config.json").read_text())["modules_to_save"]
    load_adapter(fresh, lora_only)
    torch.testing.assert_close(_logits(fresh), base_logits, rtol=1e-6, atol=1e-6)


def test_config_keys_and_their_checks(tiny_dir):
    cfg = load_config(None, [])
    assert cfg.moe.train_router is False and cfg.moe.aux_loss_coef == 0.0
    with pytest.raises(ConfigError, match="moe.aux_loss_coef"):
        load_config(None, ["moe.aux_loss_coef=-0.01"])
    with pytest.raises(ConfigError, match="moe.train_router"):
        load_config(None, ["moe.train_router=3"])
    dense = load_config(None, [f"model.name={tiny_dir}", "model.device=cpu"])
    for kw, key in (({"train_router": True}, "moe.train_router"), ({"aux_loss": True}, "aux_loss_coef")):
        with pytest.raises(ValueError, match=f"{key}.*not a mixture-of-experts"):
            build_policy(dense.model, LoraConfig(r=4, alpha=8), torch.device("cpu"), **kw)


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2_moe") / "model"
    tiny_moe("qwen2_moe", dtype=torch.bfloat16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_train_router_with_aux_loss_and_reload(qwen2_moe_dir, data_file, tmp_path):  # noqa: F811
    cfg = load_config(None, _overrides(qwen2_moe_dir, data_file, tmp_path / "run", steps=2,
                                       **{"model.device": "cpu", "moe.train_router": True,
                                          "moe.aux_loss_coef": 0.01, "optim.lr": 1e-2}))
    trainer = Trainer(cfg)
    model = trainer.model
    routers = {n: p.detach().clone() for n, p in router_parameters(model).items()}
    assert len(routers) == 4 and all(p.requires_grad for p in router_parameters(model).values())
    assert {id(p) for p in router_parameters(model).values()} <= {id(p) for p in trainer.params}
    adapter = trainer.train()
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(m["aux_loss"] > 1.9 for m in metrics)  # k = 2 is its minimum
    for n, p in router_parameters(model).items():
        assert not torch.equal(p, routers[n]), f"{n} did not move"
    fresh, _ = build_policy(load_config(None, _overrides(qwen2_moe_dir, data_file, tmp_path / "x",
                                                         **{"model.adapter": str(adapter)})).model,
                            LoraConfig(r=4, alpha=8), torch.device("cpu"))
    ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    torch.testing.assert_close(_logits(fresh, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    assert router_modules(fresh)  # and the routers were loaded, not left at the base
    for n, p in router_parameters(fresh).items():
        torch.testing.assert_close(p, router_parameters(model)[n], rtol=0, atol=0)
