"""Random weights as a load source (`random:SHAPE[,layers=N]`, qerl.models.random_weights): the loader builds the
shape's config layer by layer, the same model as the bench's builder for the same seed, and refuses what it
cannot build before building anything."""

import pytest
import torch

from qerl.models import ModelSpec, Quantization, load_policy, quant_layers
from qerl.models.random_weights import random_config, random_name, random_policy, shape_names
from qerl.models.shapes import QWEN25, SMOLLM2_135M
from qerl.nn import LoraConfig


def test_names_resolve_to_the_shapes_configs():
    assert random_name("7b") == "random:qwen2.5-7b" and random_name("gpt-oss-20b", 2) == "random:gpt-oss-20b,layers=2"
    cfg = random_config("random:qwen2.5-7b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (3584, 28, QWEN25["7b"]["vocab_size"])
    assert random_config("random:qwen2.5-72b,layers=2").num_hidden_layers == 2
    small = random_config("random:smollm2-135m")
    assert (small.model_type, small.hidden_size) == ("llama", SMOLLM2_135M["hidden_size"])
    assert random_config("random:qwen3-30b-a3b,layers=1").model_type == "qwen3_moe"
    assert len(shape_names()) == len(QWEN25) + 3
    for bad in ("random:qwen2.5-8b", "random:qwen2.5-7b,layers=0", "random:", "random:7b"):
        with pytest.raises(ValueError, match="random:SHAPE"):
            random_config(bad)


def test_the_loader_builds_what_the_bench_builds():
    spec = ModelSpec("random:smollm2-135m,layers=1", format="nvfp4", lora=LoraConfig(r=4, alpha=8), dtype="bf16",
                     device="cpu")
    model, tokenizer = load_policy(spec)
    assert tokenizer is None and not model.training and model.config.use_cache is False
    assert len(quant_layers(model)) == 7 and model.config.qerl_weight_format == "nvfp4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # a trained-looking adapter
    same = random_policy(random_config(spec.name), Quantization.of("nvfp4", lora=LoraConfig(r=4, alpha=8)),
                         torch.device("cpu"))
    ours, theirs = model.state_dict(), same.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k].view(-1).view(torch.uint8), theirs[k].view(-1).view(torch.uint8)), k


def test_what_random_weights_cannot_be_is_refused_before_building():
    with pytest.raises(ValueError, match="weight format"):
        load_policy(ModelSpec("random:smollm2-135m,layers=1"))
    with pytest.raises(ValueError, match="random:SHAPE"):
        load_policy(ModelSpec("random:llama-7b", format="nvfp4"))
