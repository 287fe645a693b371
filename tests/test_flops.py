"""The update's useful FLOPs (qerl.rl.flops): against a brute-force pair count, a hand count of a 2-layer model, and
torch's FlopCounterMode over real forward + backward passes of tiny quantized LoRA models.

FlopCounterMode counts every matrix product torch dispatches (mm, addmm, bmm, and the LoRA epilogue's in-place
addmm_, which it does not know: counted here as 2 M N K). Its counts must equal ours exactly (tolerance 0, all
integers) for the linear products (base, LoRA, routers, experts, LM head). For attention the models run HF's eager
attention, whose two bmm per layer forward (and the four of the backward) cover the whole [s, s] square, masked
or not; ours counts the causal pairs, s (s + 1) / 2 for one sequence: the two must agree after scaling by that
ratio, exactly.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import GptOssConfig, LlamaConfig, MixtralConfig

from qerl.kernels import dequantized_weights
from qerl.models import quantize_model
from qerl.nn import LoraConfig
from qerl.rl.flops import PassLayout, causal_pairs, lora_of, model_shape, pass_flops, total, update_flops
from qerl.rl.losses import LossSettings
from qerl.rl.update import UpdateSettings, policy_update

from test_packing import ALL_IN_ONE, SPLIT, _experience, make_batch, policy
from tiny import tiny_model
from tiny_moe import tiny_moe

aten = torch.ops.aten
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _inplace_addmm(c, a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0] * a[1] * b[1]


def _counted(fn) -> dict[str, int]:
    """{op: FLOPs} FlopCounterMode counts while fn runs (CPU: every weight dequantized, as the update does)."""
    with dequantized_weights(True), FlopCounterMode(display=False, custom_mapping={aten.addmm_: _inplace_addmm}) as fc:
        fn()
    return {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}


def _products(counted: dict[str, int]) -> int:
    return sum(n for op, n in counted.items() if op in ("aten.mm", "aten.addmm", "aten.addmm_"))


def test_causal_pairs_equal_a_brute_force_count():
    for prefix, length, window in [(0, 1, None), (0, 7, None), (5, 4, None), (0, 9, 3), (2, 6, 3), (10, 5, 4),
                                   (1, 3, 8), (0, 0, None)]:
        brute = sum(1 for q in range(prefix, prefix + length) for j in range(q + 1)
                    if window is None or q - j < window)
        assert causal_pairs(prefix, length, window) == brute, (prefix, length, window)
    layout = PassLayout(((0, 5), (5, 6), (5, 1), (0, 3)), head_tokens=7)
    assert layout.tokens == 15 and layout.attention_pairs() == 15 + (6 + 7 + 8 + 9 + 10 + 11) + 6 + (1 + 2 + 3)


def test_a_two_layer_model_counted_by_hand():
    config = LlamaConfig(hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4, vocab_size=10)
    # a prompt of 3 and one completion of 2 after it: 5 tokens, 1+2+3 + 4+5 = 15 pairs; 2 loss tokens
    layout = PassLayout(((0, 3), (3, 2)), head_tokens=2)
    t, r = 5, 2
    nk = dict(q=(8, 8), k=(4, 8), v=(4, 8), o=(8, 8), gate=(12, 8), up=(12, 8), down=(8, 12))
    base_fwd = 2 * t * sum(n * k for n, k in nk.values())  # 4800 per layer
    first_layer_inputs = ("q", "k", "v")  # fed by the embedding output: no input gradient
    base_bwd = 2 * t * sum(n * k for name, (n, k) in nk.items() if name not in first_layer_inputs) + base_fwd
    lora_fwd = 2 * t * r * sum(n + k for n, k in nk.values())
    lora_bwd_full = 2 * t * r * sum(2 * n + 2 * k for n, k in nk.values())  # dh, dB, dA, dx
    lora_bwd_first = lora_bwd_full - 2 * t * r * sum(nk[name][1] for name in first_layer_inputs)
    attention_fwd = 2 * 2 * 4 * 2 * 15  # (QK^T + PV) x 2 head_dim x 2 heads x 15 pairs
    head = 2 * 2 * 10 * 8
    assert (base_fwd, base_bwd, lora_fwd, lora_bwd_full, lora_bwd_first) == (4800, 8320, 2320, 4640, 4160)
    by = pass_flops(config, layout, (r, ALL, False), backward=True)
    assert by == {"base": (2 * base_fwd, base_bwd), "lora": (2 * lora_fwd, lora_bwd_full + lora_bwd_first),
                  "attention": (2 * attention_fwd, 4 * attention_fwd), "head": (head, head)}
    loss_pass = 9600 + 8320 + 4640 + 8800 + 960 + 1920 + 320 + 320
    with_lora, reference = 9600 + 4640 + 960 + 320, 9600 + 960 + 320  # forward only; the reference without LoRA
    assert total(by) == loss_pass == 34880
    assert update_flops(config, layout, (r, ALL, False), loss_passes=1) == loss_pass
    assert update_flops(config, layout, (r, ALL, False), loss_passes=2, old_logprob_pass=True,
                        reference_pass=True) == 2 * loss_pass + with_lora + reference == 96160


def test_sliding_window_layers_count_at_most_window_keys():
    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=3, vocab_size=160)
    layout = PassLayout(((0, 6), (6, 4)), head_tokens=4)
    by = pass_flops(config, layout, None, backward=False)
    full, windowed = causal_pairs(0, 10), causal_pairs(0, 10, 3)
    assert (full, windowed) == (55, 27)
    assert by["attention"] == (2 * 2 * 16 * 4 * 2 * (full + windowed), 0)  # layers alternate sliding / full
    assert by["experts"][0] == 4 * 10 * 2 * (2 * 2 * 64 * 64 + 2 * 64 * 64)  # 4 layers, top-2 of gate_up and down


def test_an_unknown_mixture_of_experts_is_not_counted():
    config = MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=160)
    assert model_shape(config) is None
    assert update_flops(config, PassLayout(((0, 4),), 4), None, loss_passes=1) is None


def _forward_backward(model, s: int = 11, heads=(3, 5, 9)):
    ids = torch.randint(3, 150, (1, s), generator=torch.Generator().manual_seed(s))
    rows = torch.tensor(heads)

    def run():
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        model.lm_head(hidden[rows]).float().log_softmax(-1).sum().backward()

    return run, PassLayout(((0, s),), len(heads))


def _tiny(kind: str):
    if kind.startswith("qwen2:"):  # LoRA on these targets only
        targets = tuple(kind.split(":")[1].split(","))
        return quantize_model(tiny_model("qwen2", attn_implementation="eager"), "nvfp4",
                              LoraConfig(r=4, alpha=8, targets=targets), targets=targets)
    if kind == "gpt_oss":
        from test_gpt_oss import tiny_gpt_oss

        return quantize_model(tiny_gpt_oss(sliding_window=100), "nvfp4", LoraConfig(r=4, alpha=8))
    arch, _, experts = kind.partition("+")
    return quantize_model(tiny_moe(arch, attn_implementation="eager"), "nvfp4",
                          LoraConfig(r=4, alpha=8, experts=experts == "experts"))


@pytest.mark.parametrize("kind", ["qwen2:" + ",".join(ALL), "qwen2:down_proj", "qwen2:v_proj", "qwen3_moe",
                                  "qwen2_moe+experts", "gpt_oss"])
def test_a_forward_and_backward_counts_what_flop_counter_counts(kind):
    """One sequence of 11 tokens, 3 of them through the LM head, no checkpointing: every product once. LoRA on
    the down projection only leaves the first layer's attention without a backward; on v only, its dQ, dK, dP."""
    model = _tiny(kind)
    run, layout = _forward_backward(model)
    lora = lora_of(model)
    assert lora[0] == 4 and lora[2] == kind.endswith("+experts")
    counted = _counted(run)
    by = pass_flops(model.config, layout, lora, backward=True)
    attention = by.pop("attention")
    assert _products(counted) == total(by)
    s = 11
    assert counted["aten.bmm"] * causal_pairs(0, s) == sum(attention) * s * s


@pytest.mark.parametrize("budget", [ALL_IN_ONE, SPLIT])
def test_the_update_reports_every_pass(budget):
    """policy_update's update_flops: two loss passes, the old-log-prob pass and the reference pass on the packed
    layout it planned (groups split over micro-batches repeat their prompt). FlopCounterMode sees the products
    once each, plus the LM head's forward again in each backward (its chunks are checkpointed)."""
    exp = _experience(make_batch(seed=4))
    model = policy("qwen2", "nvfp4")
    settings = UpdateSettings(LossSettings("grpo", 0.2, 0.2, 0.05, 6), num_updates=2, max_grad_norm=1e9,
                              max_tokens_per_micro_batch=budget)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    stats = {}
    counted = _counted(lambda: stats.update(policy_update(model, exp, opt, params, settings)))
    # the batch (tests/test_packing.GROUPS): prompts 5, 3, 7 with rows of 6, 1, 0 | 4, 2 | 6, 6, 6 loss tokens
    segments = [(0, 5), (5, 6), (5, 1), (0, 3), (3, 4), (3, 2), (0, 7), (7, 6), (7, 6), (7, 6)]
    if budget == SPLIT:  # the second and third groups are cut: their prompt again in the next micro-batch
        segments = [(0, 5), (5, 6), (5, 1), (0, 3), (3, 4), (0, 3), (3, 2), (0, 7), (7, 6), (0, 7), (7, 6), (7, 6)]
    layout = PassLayout(tuple(segments), head_tokens=31)
    assert layout.tokens == stats["loss_tokens_computed"]
    lora = (4, ALL, False)
    assert stats["update_flops"] == update_flops(model.config, layout, lora, loss_passes=2, old_logprob_pass=True,
                                                 reference_pass=True)
    products = 0
    for backward, lora_on, passes in ((True, True, 2), (False, True, 1), (False, False, 1)):
        by = pass_flops(model.config, layout, lora if lora_on else None, backward=backward)
        by.pop("attention")
        products += passes * (total(by) + (by["head"][0] if backward else 0))
    assert _products(counted) == products


def test_the_padded_update_counts_each_row_without_its_padding():
    exp = _experience(make_batch(seed=4))
    model = policy("llama", "nvfp4")
    params = [p for p in model.parameters() if p.requires_grad]
    settings = UpdateSettings(LossSettings("grpo", 0.2, 0.2, 0.0, 6), packing=False, micro_batch_size=3)
    stats = policy_update(model, exp, torch.optim.SGD(params, lr=0.0), params, settings)
    rows = [(5, 6), (5, 1), (3, 4), (3, 2), (7, 6), (7, 6), (7, 6)]  # (prompt, loss tokens); the empty row left out
    layout = PassLayout(tuple((0, p + n) for p, n in rows), head_tokens=31)
    assert stats["update_flops"] == update_flops(model.config, layout, (4, ALL, False), loss_passes=1)


def test_lora_of_reads_rank_targets_and_expert_lora_from_the_parameters():
    model = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=3, alpha=6, targets=("q_proj", "down_proj")),
                           targets=("q_proj", "down_proj"))
    assert lora_of(model) == (3, ("down_proj", "q_proj"), False)
    assert lora_of(tiny_model("llama")) is None  # nothing trainable named lora_A
    moe = quantize_model(tiny_moe("qwen3_moe"), "nvfp4", LoraConfig(r=2, alpha=4, experts=True))
    assert lora_of(moe) == (2, ("k_proj", "o_proj", "q_proj", "v_proj"), True)
