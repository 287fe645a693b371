"""Tiny random models and an offline tokenizer for fast unit tests (no hub access needed)."""

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config)

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}


def tiny_config(arch: str = "llama", **overrides):
    kwargs = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=arch in ("qwen2", "qwen3"), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return _CONFIGS[arch](**kwargs)


def tiny_model(arch: str = "llama", dtype=torch.float32, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=dtype)
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII: ids 0-2 are pad/bos/eos, 3.. are characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def write_arith(path, a_values=range(1, 5), b_values=range(1, 5)):
    """A JSONL problem file of sums "a+b=?" (answer a + b) for every a, b given; returns path."""
    import json

    rows = [{"question": f"{a}+{b}=?", "answer": str(a + b)} for a in a_values for b in b_values]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_run_args(tiny_dir, data_file, out, **extra) -> list[str]:
    """`qerl train` KEY=VALUE overrides of a seconds-long run on the tiny model (2 prompts x 2, 4 new tokens, 2
    steps, a checkpoint each), extra keys added or replacing these."""
    base = {"model.name": str(tiny_dir), "data.train": str(data_file), "data.max_prompt_tokens": 32,
            "data.suffix": "none", "rollout.prompts_per_step": 2, "rollout.group_size": 2,
            "rollout.max_new_tokens": 4, "lora.r": 4, "lora.alpha": 8, "steps": 2, "save_every": 1,
            "output_dir": str(out), "tensorboard": False, "plots": False, "reward_timeout_s": 30, **extra}
    return [f"{k}={v}" for k, v in base.items()]
