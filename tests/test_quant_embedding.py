"""Opt-in 4-bit input embedding (`QuantEmbedding`): exact lookups, model surgery, checkpoints, the rollout
engine and the trainer option. CPU, tiny untied models (tiny Llama is untied; tiny Qwen2 is tied)."""

import json

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model, tiny_tokenizer

from qerl.formats import get_format
from qerl.formats.fp4 import unpack_fp4
from qerl.models import (dequantize_model, load_causal_lm, memory_report, quant_embeddings, quant_layers,
                         quantize_input_embeddings, quantize_model, save_quantized)
from qerl.nn import LoraConfig, QuantEmbedding

FORMATS = ("nvfp4", "mxfp4", "nf4")
IDS = torch.randint(3, 150, (2, 19), generator=torch.Generator().manual_seed(1))


def _table(vocab: int, dim: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Random rows of very different scales, two all-zero rows, one row spanning many codes."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(vocab, 1).uniform_(-4, 1, generator=g))
    w = torch.randn(vocab, dim, generator=g) * scale
    w[vocab // 2] = 0
    w[-1] = 0
    if vocab > 3:
        w[1] = torch.linspace(-6, 6, dim)  # every E2M1 magnitude and both signs in a row
    return w.to(dtype)


def _codes(q: QuantEmbedding) -> torch.Tensor:
    if q.weight_format == "nf4":
        return torch.stack([q.weight_packed >> 4, q.weight_packed & 0x0F], -1).reshape(-1)
    return unpack_fp4(q.weight_packed).reshape(-1)


def _embedding(table: torch.Tensor) -> torch.nn.Embedding:
    emb = torch.nn.Embedding(*table.shape, dtype=table.dtype)
    with torch.no_grad():
        emb.weight.copy_(table)
    return emb


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("vocab", [1, 7, 157, 1001])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lookup_equals_embedding_of_the_dequantized_table(fmt, vocab, dtype):
    q = QuantEmbedding.from_embedding(_embedding(_table(vocab, 128, dtype, seed=vocab)), get_format(fmt))
    assert not list(q.parameters()) and all(not t.requires_grad for t in q.buffers())
    dense = q.dequantized_weight()
    assert dense.dtype == dtype and dense.shape == (vocab, 128)
    g = torch.Generator().manual_seed(vocab)
    for ids in (torch.arange(vocab), torch.randint(0, vocab, (3, 5, 11), generator=g), torch.zeros(0, dtype=torch.long),
                torch.tensor(vocab - 1)):
        out = q(ids)
        assert out.dtype == dtype and out.shape == (*ids.shape, 128)
        ref = F.embedding(ids, dense)
        assert torch.equal(out.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8)), ids.shape  # bit-exact
    if vocab > 3:
        assert set(_codes(q).unique().tolist()) == set(range(16))  # every code decoded at least once
        assert torch.equal(q(torch.tensor([vocab // 2, vocab - 1])), torch.zeros(2, 128, dtype=dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_dequantizes_only_the_looked_up_rows(fmt, monkeypatch):
    import qerl.nn.quant_embedding as qe

    q = QuantEmbedding.from_embedding(_embedding(_table(1001, 128)), get_format(fmt))
    spec, seen = get_format(fmt), []

    class Spy:
        def dequantize(self, **tensors):
            seen.append(tensors["weight_packed"].shape)
            return spec.dequantize(**tensors)

    monkeypatch.setattr(qe, "get_format", lambda name: Spy())
    q(torch.tensor([[5, 9, 5]]))
    assert seen == [(3, 64)]  # 3 rows of packed bytes, never the 1001-row table


def test_shape_and_format_are_checked():
    with pytest.raises(ValueError, match="block size 64"):
        QuantEmbedding.from_embedding(torch.nn.Embedding(10, 96), get_format("nf4"))  # 96 % 64: an NF4 block spans rows
    with pytest.raises(ValueError, match="4-bit format"):
        QuantEmbedding.from_embedding(torch.nn.Embedding(10, 64), get_format("bf16"))
    with pytest.raises(ValueError, match="4-bit format"):
        quantize_model(tiny_model("llama"), "bf16", embeddings=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_logits_equal_a_model_with_the_dequantized_table(fmt):
    ours = quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt, embeddings=True)
    emb = ours.get_input_embeddings()
    assert isinstance(emb, QuantEmbedding) and emb.weight_format == fmt
    assert "model.embed_tokens.weight" not in ours.state_dict()
    twin = quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt)
    with torch.no_grad():
        twin.get_input_embeddings().weight.copy_(emb.dequantized_weight())
    with torch.no_grad():
        assert torch.equal(ours(input_ids=IDS).logits, twin(input_ids=IDS).logits)
    # the default leaves the embedding 16-bit
    assert isinstance(twin.get_input_embeddings(), torch.nn.Embedding)


def test_tied_model_is_refused_and_left_unchanged():
    model = tiny_model("qwen2", dtype=torch.bfloat16)  # tie_word_embeddings=True, like SmolLM2
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with pytest.raises(ValueError, match="tied to lm_head"):
        quantize_model(model, "nvfp4", embeddings=True)
    assert not quant_layers(model) and isinstance(model.get_input_embeddings(), torch.nn.Embedding)
    with pytest.raises(ValueError, match="tied to lm_head"):
        quantize_input_embeddings(model, get_format("nvfp4"))


def test_lora_gradients_still_flow():
    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8), embeddings=True)
    model(input_ids=IDS, labels=IDS).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_report_counts_the_embedding_as_quantized_base(fmt):
    plain = memory_report(quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt))
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt, embeddings=True)
    report = memory_report(model)
    V, D = 160, 64
    emb_bytes = {"nvfp4": V * D * 4.5 / 8 + 4, "mxfp4": V * D * 4.25 / 8, "nf4": V * D * 4.5 / 8}[fmt]
    assert report["quantized_params"] == plain["quantized_params"] + V * D
    assert report["quantized_bytes"] == plain["quantized_bytes"] + emb_bytes
    assert report["other_bytes"] == plain["other_bytes"] - V * D * 2
    assert report["total_bytes"] == plain["total_bytes"] - V * D * 2 + emb_bytes


def test_dequantize_model_gives_back_an_nn_embedding():
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4", embeddings=True)
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    table = model.get_input_embeddings().dequantized_weight()
    dequantize_model(model, torch.bfloat16)
    emb = model.get_input_embeddings()
    assert type(emb) is torch.nn.Embedding and emb.padding_idx == 0 and not quant_embeddings(model)
    assert torch.equal(emb.weight, table)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, want)


def test_requantizing_the_dequantized_bf16_table_is_exact():
    """What a reload does: quantize(dequantize(q)) on the bf16 table gives the same global scale, block
    scales and dequantized values (NVFP4 / MXFP4: a -0 code comes back as +0, same value)."""
    table = _table(4096, 256)
    for fmt in FORMATS:
        q = QuantEmbedding.from_embedding(_embedding(table), get_format(fmt))
        again = QuantEmbedding.from_embedding(_embedding(q.dequantized_weight()), get_format(fmt))
        for name, t in q.quantized_tensors().items():
            if name != "weight_packed":
                assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                                   getattr(again, name).view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                                   else getattr(again, name)), (fmt, name)
        assert torch.equal(again.dequantized_weight(), q.dequantized_weight()), fmt
        codes, codes2 = _codes(q), _codes(again)
        changed = codes != codes2
        if fmt == "nf4":
            assert not changed.any()
        else:
            assert set(codes[changed].tolist()) <= {8} and set(codes2[changed].tolist()) <= {0}


def test_requantizing_nvfp4_blocks_with_a_subnormal_scale_can_move_them():
    """The one inexact corner: a block whose E4M3 scale is the subnormal 2^-9 or 2^-8 (block amax below
    ~1.6e-5 of the table's amax) may get a smaller scale on re-quantization; its values move by less than
    3e-6 of the table's amax."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.exp(torch.empty(4096, 16, 1).uniform_(-16, 0, generator=g))
    table = (torch.randn(4096, 16, 16, generator=g) * blocks).reshape(4096, 256).bfloat16()
    q = QuantEmbedding.from_embedding(_embedding(table), get_format("nvfp4"))
    again = QuantEmbedding.from_embedding(_embedding(q.dequantized_weight()), get_format("nvfp4"))
    moved = q.weight_scale.float() != again.weight_scale.float()
    assert moved.any() and (q.weight_scale.float()[moved] <= 2 ** -8).all()
    amax = q.dequantized_weight().abs().max()
    assert (q.dequantized_weight() - again.dequantized_weight()).abs().max() < 3e-6 * amax


@pytest.mark.parametrize("fmt", FORMATS)
def test_saved_directory_is_standard_and_reloads_to_the_same_lookups(tmp_path, fmt):
    from safetensors import safe_open

    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt, embeddings=True)
    emb = model.get_input_embeddings()
    save_quantized(model, tiny_tokenizer(), tmp_path / "q")
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        table = f.get_tensor("model.embed_tokens.weight")
    assert not any(k.startswith("model.embed_tokens.") and k != "model.embed_tokens.weight" for k in keys)
    assert table.dtype == torch.bfloat16 and torch.equal(table, emb.dequantized_weight())
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert "embed_tokens" not in json.dumps(qcfg)  # not a target, not in any list
    if fmt != "nf4":
        assert qcfg["config_groups"]["group_0"]["targets"] == ["Linear"]

    loaded, _ = load_causal_lm(tmp_path / "q")
    assert isinstance(loaded.get_input_embeddings(), torch.nn.Embedding)  # dense as stored
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits)
    again = quantize_input_embeddings(loaded, get_format(loaded.config.qerl_weight_format))
    ids = torch.arange(160)
    assert torch.equal(again(ids), emb(ids))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_transformers_loads_the_saved_directory(tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), fmt, embeddings=True)
    save_quantized(model, None, tmp_path / "q")
    if fmt == "nf4":
        pytest.importorskip("bitsandbytes")
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    else:
        from transformers import CompressedTensorsConfig

        theirs = AutoModelForCausalLM.from_pretrained(
            tmp_path / "q", quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16)
    emb = theirs.get_input_embeddings()
    assert type(emb) is torch.nn.Embedding
    assert torch.equal(emb.weight, model.get_input_embeddings().dequantized_weight())
    if fmt != "nf4":  # bnb's bf16 compute path differs; its layers are checked in test_checkpoint.py
        with torch.no_grad():
            assert torch.equal(theirs(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_engine_greedy_matches_hf_generate_with_quantized_embedding():
    from test_rollout_engine import completions, hf_greedy, prompts_of, quantize_tiny
    from test_rollout_engine import tiny_model as engine_model

    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    model = quantize_tiny(engine_model("qwen2"))  # untied, fp32, NVFP4 + non-zero LoRA
    quantize_input_embeddings(model, get_format("nvfp4"))
    prompts = prompts_of([4, 11, 7], seed=3)
    engine = RolloutEngine(model, max_seq_len=64)
    assert engine.runner.dtype == torch.float32
    out = engine.generate(prompts, 16, SamplingParams(temperature=0), ignore_eos=True)
    assert completions(out) == hf_greedy(model, prompts, 16)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("untied") / "model"
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_trainer_option_builds_and_trains(untied_dir, tmp_path):
    from qerl.config import load_config
    from qerl.models.policy import build_policy
    from qerl.rl.trainer import Trainer

    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=?", "answer": str(a + b)}) + "\n"
                            for a in range(1, 4) for b in range(1, 4)))
    overrides = {"model.name": str(untied_dir), "model.quantize_embeddings": "true", "data.train": str(data),
                 "data.max_prompt_tokens": 32, "data.suffix": "none", "rollout.prompts_per_step": 2,
                 "rollout.group_size": 2, "rollout.max_new_tokens": 4, "lora.r": 4, "lora.alpha": 8, "steps": 1,
                 "output_dir": str(tmp_path / "run"), "tensorboard": False, "plots": False,
                 "rewards": "['tiny_rewards:digit_reward']"}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    assert cfg.model.quantize_embeddings is True
    assert load_config(None, []).model.quantize_embeddings is False  # off by default
    trainer = Trainer(cfg)
    assert isinstance(trainer.model.get_input_embeddings(), QuantEmbedding)
    trainer.train()
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()

    # an already quantized directory: the option re-quantizes its dense embedding after loading
    model, tok = build_policy(cfg.model, cfg.lora, torch.device("cpu"))
    save_quantized(model, tok, tmp_path / "q")
    cfg.model.name = str(tmp_path / "q")
    reloaded, _ = build_policy(cfg.model, cfg.lora, torch.device("cpu"))
    emb = reloaded.get_input_embeddings()
    assert isinstance(emb, QuantEmbedding)
    assert torch.equal(emb(torch.arange(160)), model.get_input_embeddings()(torch.arange(160)))
    cfg.model.quantize_embeddings = False
    assert type(build_policy(cfg.model, cfg.lora, torch.device("cpu"))[0].get_input_embeddings()) is torch.nn.Embedding
