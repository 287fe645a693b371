"""`qerl train` on tiny random mixture-of-experts checkpoints (Qwen3-MoE; Qwen2-MoE with its shared expert),
CPU: loaded whole through transformers, experts quantized to frozen NVFP4 `QuantExperts`, LoRA on attention
and the shared expert, the router frozen and its auxiliary loss off, AQN on; the adapter reloads."""

import pytest
import torch

from qerl.config import load_config
from qerl.models import load_adapter, lora_parameters
from qerl.models.pretrained import plain_hf_directory
from qerl.models.policy import build_policy
from qerl.nn import LoraConfig
from qerl.nn.quant_experts import QuantExperts
from qerl.rl.run_log import read_metrics
from qerl.rl.trainer import Trainer

from test_train_e2e import _overrides, data_file  # noqa: F401  (a fixture)
from tiny import tiny_tokenizer

transformers = pytest.importorskip("transformers")
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, output_router_logits=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    if request.param == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, head_dim=16))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**COMMON, shared_expert_intermediate_size=32))
    d = tmp_path_factory.mktemp(request.param) / "model"
    model.to(torch.bfloat16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_moe_is_loaded_whole_not_streamed(moe_dir):
    assert plain_hf_directory(moe_dir) is None


def test_train_a_moe_checkpoint_and_reload_its_adapter(moe_dir, data_file, tmp_path):  # noqa: F811
    cfg = load_config(None, _overrides(moe_dir, data_file, tmp_path / "run", steps=2, **{"model.device": "cpu"}))
    trainer = Trainer(cfg)
    model = trainer.model
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2 and all(e.weight_format == "nvfp4" for e in experts)
    assert model.config.output_router_logits is False  # the checkpoint asked for them: RL turns them off
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert routers and not any(p.requires_grad for n, p in model.named_parameters() if n in routers)
    lora = lora_parameters(model)
    assert any(".self_attn.q_proj." in n for n in lora)
    assert not any(".experts." in n or n.endswith("mlp.gate.weight") for n in lora)
    if model.config.model_type == "qwen2_moe":
        assert any(".shared_expert.gate_proj." in n for n in lora)
    before = {n: p.detach().clone() for n, p in lora.items() if "lora_B" in n}
    adapter = trainer.train()

    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor([m["reward"], m["entropy"], m["loss"]])).all() for m in metrics)
    assert metrics[1]["aqn_sigma"] > 0
    assert not any("aux_loss" in m for m in metrics)  # moe.aux_loss_coef defaults to 0: no load-balancing loss
    after = lora_parameters(model)
    assert any(not torch.equal(before[n], after[n]) for n in before), "no LoRA weight moved"
    for n, p in model.named_parameters():
        if n in routers:
            assert torch.equal(p, routers[n]), f"{n} changed"

    fresh, _ = build_policy(cfg.model, LoraConfig(r=4, alpha=8), torch.device("cpu"))
    load_adapter(fresh, adapter)
    ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
