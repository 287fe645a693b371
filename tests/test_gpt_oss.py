"""gpt-oss (transformers' GptOssForCausalLM) on CPU, tiny random configs, fp32, always against transformers' own
modules: 4-bit `GptOssQuantExperts` (biases, interleaved gate/up, clamped SwiGLU) == GptOssExperts on the
dequantized weights; a checkpoint with MXFP4 experts in the released layout loads bit for bit (codes and
scales == the file's), its logits == transformers' own dequantizing loader, and it saves back bit for bit;
the packed loss pass with attention sinks and sliding windows == the padded eager path; the rollout engine's
greedy decode == HF generate; `qerl train` runs two GRPO steps on such a checkpoint."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qerl.formats.fp4 import unpack_fp4
from qerl.formats.mxfp4 import dequantize_mxfp4
from qerl.models import lora_parameters, quant_layers, quantize_model
from qerl.models.experts import dequantize_experts_into, quantize_experts
from qerl.models.gpt_oss import load_gpt_oss_mxfp4, save_gpt_oss_mxfp4
from qerl.models.pretrained import load_causal_lm, plain_hf_directory
from qerl.models.sources import ModelLoadError
from qerl.nn import LoraConfig, QuantLinear
from qerl.nn.quant_experts_gpt_oss import GptOssQuantExperts

from tiny import tiny_tokenizer

transformers = pytest.importorskip("transformers")
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402

FORMATS = ("nvfp4", "mxfp4", "nf4")
E, H, I = 4, 64, 64  # noqa: E741 -- multiples of every block size (16, 32, 64) along K
WINDOW = 3  # sliding window of the even layers: shorter than the test sequences, so it matters
# yarn as the released models use, with original * factor = max_position_embeddings (no mismatch warning)
ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 8, "rope_theta": 150000.0}


def gpt_oss_config(**overrides) -> GptOssConfig:
    kw = dict(vocab_size=160, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=256, rope_parameters=dict(ROPE), pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, experts_implementation="eager", attn_implementation="eager")
    return GptOssConfig(**{**kw, **overrides})


def tiny_gpt_oss(seed: int = 0, **overrides) -> GptOssForCausalLM:
    """fp32, eval; weights, biases and sinks larger than the init so that every part changes the outputs."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(gpt_oss_config(**overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.2)
            elif "sinks" in name or "bias" in name:
                p.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(1))


# ---- GptOssQuantExperts against GptOssExperts ----

@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_equal_hf_experts_on_the_dequantized_weights(fmt):
    experts = tiny_gpt_oss().model.layers[0].mlp.experts
    quant = GptOssQuantExperts.from_experts(experts, fmt)
    assert list(quant.parameters()) == [] and quant.gate_up_proj_weight_packed.shape[:2] == (E, 2 * I)
    ref = copy.deepcopy(experts)
    dequantize_experts_into(ref, quant)
    assert torch.equal(ref.gate_up_proj_bias, experts.gate_up_proj_bias)  # biases kept as they were
    err = (ref.gate_up_proj - experts.gate_up_proj).norm() / experts.gate_up_proj.norm()
    assert 0 < err < 0.2
    torch.manual_seed(3)
    x = torch.randn(10, H) * 2  # large enough that both clamps of the SwiGLU bite
    idx = torch.stack([torch.randint(0, E, (10,)), torch.arange(10) % E], 1)
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % E, idx[:, 1])
    w = torch.rand(10, 2)
    pre = torch.stack([x @ ref.gate_up_proj[e] + ref.gate_up_proj_bias[e] for e in range(E)])
    assert (pre[..., ::2] > ref.limit).any() and (pre[..., 1::2].abs() > ref.limit).any()
    with torch.no_grad():
        torch.testing.assert_close(quant(x, idx, w), ref(x, idx, w), rtol=1e-5, atol=1e-5)
        # a different activation or bias handling would show: the plain SwiGLU without the clamps differs
        plain = copy.deepcopy(ref)
        plain.limit = float("inf")
        assert not torch.allclose(quant(x, idx, w), plain(x, idx, w), rtol=1e-3, atol=1e-3)


def test_each_expert_holds_what_a_quant_linear_of_the_transposed_weight_would():
    experts = tiny_gpt_oss().model.layers[1].mlp.experts
    quant = GptOssQuantExperts.from_experts(experts, "nvfp4")
    for e in (0, E - 1):
        for weight in ("gate_up_proj", "down_proj"):
            w = getattr(experts, weight)[e].T  # [N, K]: gate_up rows interleaved gate / up
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            for name, t in QuantLinear.from_linear(lin, "nvfp4").quantized_tensors().items():
                got = getattr(quant, f"{weight}_{name}")[e]
                assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), (weight, name)


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_logits_equal_hf_on_the_dequantized_experts(fmt, ids):
    model = tiny_gpt_oss()
    reference, original = copy.deepcopy(model), copy.deepcopy(model)
    replaced = quantize_experts(model, fmt)
    assert sorted(replaced) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(isinstance(q, GptOssQuantExperts) and q.weight_format == fmt for q in replaced.values())
    for name, quant in replaced.items():
        dequantize_experts_into(reference.get_submodule(name), quant)
    with torch.no_grad():
        got, want, orig = model(ids).logits, reference(ids).logits, original(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, orig, rtol=1e-4, atol=1e-4)


def test_grouped_forward_equals_the_reference_loop_with_biases_and_a_sentinel():
    quant = GptOssQuantExperts.from_experts(tiny_gpt_oss().model.layers[0].mlp.experts, "mxfp4")
    torch.manual_seed(5)
    index = torch.randint(0, E - 1, (32, 2))  # expert E - 1 receives nothing
    index[3, 1] = E  # an expert-parallel sentinel pair: skipped by both
    weights, hidden = torch.rand(32, 2), torch.randn(32, H) * 2

    def plain(x, offsets, weight):
        offsets = offsets.tolist()
        out = torch.zeros(x.shape[0], 2 * I if weight == "gate_up_proj" else H)
        for e in range(E):
            out[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]] @ quant.dequantized_expert(weight, e).T
        return out

    got = quant.grouped_forward(hidden, index, weights, plain)
    torch.testing.assert_close(got, quant.reference_forward(hidden, index, weights), rtol=1e-5, atol=1e-5)


def test_gradient_reaches_the_input_and_dtype_casts_keep_the_codes():
    quant = GptOssQuantExperts.from_experts(tiny_gpt_oss().model.layers[0].mlp.experts, "mxfp4")
    x = torch.randn(6, H, requires_grad=True)
    quant(x, torch.randint(0, E, (6, 2)), torch.rand(6, 2)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    packed = quant.gate_up_proj_weight_packed.clone()
    quant.to(torch.bfloat16)
    assert quant.gate_up_proj_weight_packed.dtype == torch.uint8 and torch.equal(quant.gate_up_proj_weight_packed,
                                                                                 packed)
    assert quant.gate_up_proj_bias.dtype == torch.bfloat16 and quant.down_proj_bias.dtype == torch.bfloat16


def test_an_altered_gpt_oss_layout_is_refused_before_any_change():
    model = tiny_gpt_oss()
    model.model.layers[1].mlp.experts.is_concatenated = True
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts \(GptOssExperts\): is_concatenated=True"):
        quantize_experts(model, "mxfp4")
    assert all(isinstance(layer.mlp.experts, GptOssExperts) for layer in model.model.layers)
    model = tiny_gpt_oss()
    del model.model.layers[0].mlp.experts.down_proj_bias
    with pytest.raises(ValueError, match=r"expected exactly the parameters gate_up_proj, gate_up_proj_bias"):
        quantize_experts(model, "nvfp4")


def test_surgery_lora_on_biased_attention_router_frozen(ids):
    model = quantize_model(tiny_gpt_oss(), "nvfp4", lora=LoraConfig(r=4, alpha=8))
    layers = quant_layers(model)
    assert sorted({n.rpartition(".")[2] for n in layers}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert all(m.bias is not None and m.lora_A is not None for m in layers.values())
    assert all(isinstance(layer.mlp.experts, GptOssQuantExperts) for layer in model.model.layers)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and trainable
    router = model.model.layers[0].mlp.router
    assert router.weight.dtype == torch.float32 and not router.weight.requires_grad
    assert not model.model.layers[0].self_attn.sinks.requires_grad
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


# ---- the released MXFP4 checkpoint layout ----

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def spec_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """From the layout's description alone: blocks uint8 [E, N, G, 16], scales uint8 [E, N, G] -> the
    GptOssExperts parameter [E, K = 32 G, N] fp32 (even element in the low nibble, value * 2^(scale - 127))."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32).long()
    values = torch.tensor(FP4_VALUES)[codes] * torch.exp2(scales.float() - 127)[..., None]
    e, n, g = scales.shape
    return values.reshape(e, n, g * 32).transpose(1, 2)


def random_blocks(n: int, k: int, g: torch.Generator, scale_range=(119, 126)):
    return (torch.randint(0, 256, (E, n, k // 32, 16), generator=g, dtype=torch.uint8),
            torch.randint(*scale_range, (E, n, k // 32), generator=g, dtype=torch.uint8))


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """A tiny gpt-oss checkpoint in the released layout: bf16 tensors, experts as random MXFP4 blocks / scales."""
    d = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "model"
    tiny_gpt_oss(seed=2).to(torch.bfloat16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    (shard,) = d.glob("*.safetensors")
    state = load_file(str(shard))
    g = torch.Generator().manual_seed(7)
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts."
        del state[prefix + "gate_up_proj"], state[prefix + "down_proj"]
        for weight, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            state[prefix + weight + "_blocks"], state[prefix + weight + "_scales"] = random_blocks(n, k, g)
    shard.unlink()
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_spec_and_qerl_dequantization_equal_transformers_bit_for_bit():
    """Every code and every finite scale exponent: the spec reference, qerl's MXFP4 decode of the mapped
    tensors and transformers' `convert_moe_packed_tensors` agree exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks, scales = random_blocks(2 * I, H, g, scale_range=(0, 255))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    assert torch.equal(spec_dequantize(blocks, scales), theirs)
    ours = torch.stack([dequantize_mxfp4(blocks[e].reshape(2 * I, H // 2), scales[e]) for e in range(E)])
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_loaded_codes_and_scales_are_the_files(mxfp4_dir):
    state = load_file(str(mxfp4_dir / "model.safetensors"))
    model, tokenizer = load_causal_lm(mxfp4_dir, dtype="fp32")
    assert tokenizer is not None and model.config.model_type == "gpt_oss"
    for layer in range(2):
        quant = model.model.layers[layer].mlp.experts
        assert isinstance(quant, GptOssQuantExperts) and quant.weight_format == "mxfp4"
        prefix = f"model.layers.{layer}.mlp.experts."
        for weight in ("gate_up_proj", "down_proj"):
            blocks, scales = state[prefix + weight + "_blocks"], state[prefix + weight + "_scales"]
            packed = getattr(quant, f"{weight}_weight_packed")
            assert packed.dtype == torch.uint8 and packed.shape == (E, blocks.shape[1], blocks.shape[2] * 16)
            assert torch.equal(packed, blocks.reshape(packed.shape))  # the documented reordering: a reshape
            assert torch.equal(getattr(quant, f"{weight}_weight_scale"), scales)
            # code by code: element 2i of a block row in the low nibble of byte i, as the file says
            codes = unpack_fp4(packed).reshape(*scales.shape, 32)
            assert torch.equal(codes[..., 0::2], blocks & 0x0F) and torch.equal(codes[..., 1::2], blocks >> 4)
            assert torch.equal(quant.dequantized_hf()[weight], spec_dequantize(blocks, scales))
            assert torch.equal(getattr(quant, f"{weight}_bias"), state[prefix + weight + "_bias"].float())


def test_logits_equal_transformers_dequantizing_loader(mxfp4_dir, ids):
    from transformers import Mxfp4Config

    model, _ = load_causal_lm(mxfp4_dir, dtype="fp32")
    ref = GptOssForCausalLM.from_pretrained(mxfp4_dir, quantization_config=Mxfp4Config(dequantize=True),
                                            dtype=torch.float32, experts_implementation="eager",
                                            attn_implementation="eager").eval()
    assert isinstance(ref.model.layers[0].mlp.experts, GptOssExperts)  # transformers went 16-bit
    spec = tiny_gpt_oss(seed=2)  # and a third copy, dequantized by the spec reference
    spec.load_state_dict(ref.state_dict())
    state = load_file(str(mxfp4_dir / "model.safetensors"))
    with torch.no_grad():
        for layer in range(2):
            experts, prefix = spec.model.layers[layer].mlp.experts, f"model.layers.{layer}.mlp.experts."
            for weight in ("gate_up_proj", "down_proj"):
                getattr(experts, weight).copy_(spec_dequantize(state[prefix + weight + "_blocks"],
                                                               state[prefix + weight + "_scales"]))
        got = model(ids).logits
        torch.testing.assert_close(got, ref(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, spec(ids).logits, rtol=1e-5, atol=1e-5)


def test_load_save_load_round_trips_bit_for_bit(mxfp4_dir, tmp_path, ids):
    model, tokenizer = load_gpt_oss_mxfp4(mxfp4_dir, dtype=torch.bfloat16)
    out = save_gpt_oss_mxfp4(model, tokenizer, tmp_path / "saved")
    before, after = load_file(str(mxfp4_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(after) == sorted(before)
    for key, t in before.items():
        assert after[key].dtype == t.dtype and torch.equal(after[key], t), key
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    again, _ = load_causal_lm(out, dtype="fp32")
    first, _ = load_causal_lm(mxfp4_dir, dtype="fp32")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, first(ids).logits)
    quantize_model(model, "nvfp4")
    with pytest.raises(ValueError, match="qerl-quantized linears"):
        save_gpt_oss_mxfp4(model, None, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_a_malformed_checkpoint_is_refused(mxfp4_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(mxfp4_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    key = "model.layers.1.mlp.experts.down_proj_scales"
    state[key] = state[key][:, 1:].contiguous()
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.down_proj: expected uint8 blocks"):
        load_causal_lm(bad)
    del state["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lack.*layers.0.mlp.experts.gate_up_proj_blocks"):
        load_causal_lm(bad)


def test_a_hub_id_of_an_mxfp4_checkpoint_takes_the_native_loader(mxfp4_dir, monkeypatch):
    """A hub id whose config.json says gpt-oss + mxfp4 is downloaded and loaded by qerl, not by transformers
    (which would dequantize the experts on the CPU); the hub is faked by the local directory."""
    import huggingface_hub

    fetched = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name: str(mxfp4_dir / name))
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, allow_patterns=None: fetched.append(repo) or str(mxfp4_dir))
    model, _ = load_causal_lm("someone/gpt-oss-tiny", dtype="fp32")
    assert fetched == ["someone/gpt-oss-tiny"]
    assert isinstance(model.model.layers[0].mlp.experts, GptOssQuantExperts)


def test_moe_is_loaded_whole_and_the_policy_keeps_the_files_experts(mxfp4_dir):
    from qerl.config import load_config
    from qerl.models.policy import build_policy

    assert plain_hf_directory(mxfp4_dir) is None
    cfg = load_config(None, [f"model.name={mxfp4_dir}", "model.format=nvfp4"])
    model, _ = build_policy(cfg.model, LoraConfig(r=4, alpha=8), torch.device("cpu"))
    state = load_file(str(mxfp4_dir / "model.safetensors"))
    quant = model.model.layers[0].mlp.experts
    assert quant.weight_format == "mxfp4"  # not re-quantized to the run's format
    assert torch.equal(quant.down_proj_weight_scale, state["model.layers.0.mlp.experts.down_proj_scales"])
    assert quant_layers(model)["model.layers.0.self_attn.q_proj"].weight_format == "nvfp4"


# ---- the loss pass: packed attention with sinks and sliding windows ----

def test_packed_log_probs_and_lora_gradients_equal_the_padded_eager_path():
    from test_packing import ALL_IN_ONE, SPLIT, assert_rel_close, logp_and_grads, make_batch, packed, padded

    model = quantize_model(tiny_gpt_oss(), "nvfp4", LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    assert model.config._attn_implementation == "eager"  # the padded reference: transformers' eager sinks
    batch = make_batch(seed=8)
    weights = torch.randn(batch[3].shape, generator=torch.Generator().manual_seed(1))
    ref, ref_g = logp_and_grads(model, lambda: padded(model, batch), weights)
    for budget in (ALL_IN_ONE, SPLIT):
        got, got_g = logp_and_grads(model, lambda: packed(model, batch, budget), weights)
        assert_rel_close(got, ref, what=f"logp budget {budget}")
        for n in ref_g:
            assert ref_g[n].abs().max() > 0, n
            assert_rel_close(got_g[n], ref_g[n], what=f"{n} budget {budget}")
    with torch.no_grad():  # the sinks matter: without them the log-probs differ
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
        assert not torch.allclose(packed(model, batch, SPLIT), ref, rtol=1e-3, atol=1e-3)


# ---- the rollout engine ----

def test_rollout_greedy_equals_hf_generate_both_schedulers():
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams
    from test_rollout_engine import completions, hf_greedy, prompts_of
    from test_rollout_moe import quantized

    model = quantized(tiny_gpt_oss())
    prompts = prompts_of([5, 11, 3], seed=3)
    lengths = [12, 4, 9]
    ref = [r[:n] for r, n in zip(hf_greedy(model, prompts, 12), lengths)]
    for scheduler in ("continuous", "static"):
        engine = RolloutEngine(model, max_seq_len=64, check_every=4, max_batch=2, scheduler=scheduler)
        out = engine.generate(prompts, 12, SamplingParams(temperature=0), force_lengths=lengths)
        assert completions(out) == ref, scheduler
    # the window and the sinks both change what HF generates here, so the equality above tested them
    assert engine.runner.windows == [WINDOW, None]
    model.config.sliding_window = 1000
    assert [r[:n] for r, n in zip(hf_greedy(model, prompts, 12), lengths)] != ref
    model.config.sliding_window = WINDOW
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
    assert [r[:n] for r, n in zip(hf_greedy(model, prompts, 12), lengths)] != ref


def test_rollout_sampled_log_probs_equal_a_full_forward():
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams
    from test_rollout_engine import full_forward_logprobs, prompts_of
    from test_rollout_moe import quantized

    model = quantized(tiny_gpt_oss(seed=4))
    engine = RolloutEngine(model, max_seq_len=64)
    out = engine.generate(prompts_of([3, 10], seed=7), 12, SamplingParams(temperature=0.7), seed=0, ignore_eos=True)
    lp, ent = full_forward_logprobs(model, out, 0.7)
    torch.testing.assert_close(out.logprobs, lp, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(out.entropies, ent, atol=2e-4, rtol=1e-4)


# ---- qerl train ----

def test_train_two_grpo_steps_on_an_mxfp4_checkpoint(mxfp4_dir, tmp_path):
    from qerl.config import load_config
    from qerl.models import load_adapter
    from qerl.models.policy import build_policy
    from qerl.rl.run_log import read_metrics
    from qerl.rl.trainer import Trainer
    from test_train_e2e import _overrides

    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=?", "answer": str(a + b)}) + "\n"
                            for a in range(1, 5) for b in range(1, 5)))
    cfg = load_config(None, _overrides(mxfp4_dir, data, tmp_path / "run", steps=2, **{"model.device": "cpu"}))
    trainer = Trainer(cfg)
    model = trainer.model
    assert all(isinstance(layer.mlp.experts, GptOssQuantExperts) for layer in model.model.layers)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if n.endswith(("router.weight", "router.bias", "sinks"))}
    lora = lora_parameters(model)
    assert any(".self_attn.o_proj." in n for n in lora) and not any("experts" in n or "router" in n for n in lora)
    before = {n: p.detach().clone() for n, p in lora.items() if "lora_B" in n}
    adapter = trainer.train()
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor([m["reward"], m["entropy"], m["loss"]])).all() for m in metrics)
    after = lora_parameters(model)
    assert any(not torch.equal(before[n], after[n]) for n in before), "no LoRA weight moved"
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in frozen.items())
    fresh, _ = build_policy(cfg.model, LoraConfig(r=4, alpha=8), torch.device("cpu"))
    load_adapter(fresh, adapter)
    x = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)
