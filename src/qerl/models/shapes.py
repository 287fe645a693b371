"""The model shapes the benchmarks build with random weights: one table of each model's released config.json
values, the Hugging Face configs made from them, and the (N, K) of a decoder layer's linears derived from them.

    QWEN25        Qwen2.5 dense sizes 1.5B-72B (keyword arguments of `Qwen2Config`)
    SMOLLM2_135M  SmolLM2-135M-Instruct, the embedded default model (a `LlamaConfig`'s)
    MOE_SHAPES    mixtures of experts: Qwen3-30B-A3B (`Qwen3MoeConfig`) and gpt-oss-20b (`GptOssConfig`)

`qerl bench kernels`, `rollout` and `step`, the scripts in benchmarks/ and the loader's random-weight source
(`random:qwen2.5-7b`, `qerl.models.random_weights`) take their shapes from here, so that the linears one benchmark
times are the ones another runs.
"""

QWEN25 = {  # vocab 151936 with tied embeddings up to 3B, 152064 untied from 7B up
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}

# hidden size 576 is not a multiple of 128, the Gluon kernels' K step
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)

MOE_SHAPES = {  # every layer sparse
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, tie_word_embeddings=False, norm_topk_prob=True),
    # gpt-oss-20b: transformers' GptOssConfig defaults are the 120b's attention and widths; 24 layers, 32 experts,
    # top-4; alternating sliding-window (128) and full attention, sinks, yarn RoPE, biases: the config's own
    "gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4),
}


def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """{layer: (N, K)} for y[M, N] = x[M, K] @ W[N, K]^T of one dense decoder layer of `shape` (a `QWEN25` entry
    or `SMOLLM2_135M`), q/k/v and gate/up fused as the rollout engine runs them."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", h // heads)
    return {"qkv": ((heads + 2 * kv) * head_dim, h), "o": (h, heads * head_dim), "gate_up": (2 * inter, h),
            "down": (h, inter)}


def qwen25_config(size: str, layers: int | None = None):
    """The `Qwen2Config` of a `QWEN25` size (layers: fewer decoder layers, for smoke tests)."""
    from transformers import Qwen2Config

    shape = dict(QWEN25[size])
    if layers:
        shape["num_hidden_layers"] = layers
    return Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False,
                       bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, **shape)


def moe_config(size: str, layers: int | None = None):
    """The config of a `MOE_SHAPES` shape, Qwen3-MoE or gpt-oss (layers: fewer decoder layers, for smoke
    tests)."""
    from transformers import GptOssConfig, Qwen3MoeConfig

    shape = dict(MOE_SHAPES[size])
    if layers:
        shape["num_hidden_layers"] = layers
    if size.startswith("gpt-oss"):
        n = shape["num_hidden_layers"]
        shape["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        return GptOssConfig(output_router_logits=False, **shape)
    return Qwen3MoeConfig(max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=151643,
                          eos_token_id=151645, pad_token_id=151643, output_router_logits=False, **shape)
