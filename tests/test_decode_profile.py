"""`qerl.bench.decode_profile`'s accounting on the CPU: which role each kernel of a decode step plays (from the
launch order, checked against the runner's structure) and the bytes each role must move (its floor)."""

import torch

from qerl.bench.decode_profile import assign_roles, busy_us, role_bytes, role_table
from qerl.models import quantize_model
from qerl.nn import LoraConfig
from qerl.rollout.model_runner import CausalLMRunner

from tiny import tiny_model


def _runner(fuse: bool = True):
    model = tiny_model("qwen2", hidden_size=128, intermediate_size=256)
    quantize_model(model, "nvfp4", LoraConfig(r=4, alpha=8))
    return model, CausalLMRunner(model, max_len=64, fuse_siblings=fuse)


def _step_names(layers: int, split_k_reduce_after_down: bool = False) -> list[str]:
    """The kernels of one engine decode step as an sm_90 GPU launches them, in order."""
    names = ["indexSelectSmallIndex", "_add_rms_norm_kernel"]
    for _ in range(layers):
        names += ["_lora_a_kernel", "nvfp4_swap_kernel", "_rope_store_kernel", "_split_kernel", "_combine_kernel",
                  "_lora_a_kernel", "nvfp4_swap_kernel", "_add_rms_norm_kernel",
                  "_lora_a_kernel", "permute_x_kernel", "nvfp4_swap_wgmma_kernel", "_silu_mul_kernel",
                  "_lora_a_kernel", "nvfp4_swap_kernel"]
        if split_k_reduce_after_down:
            names.append("_splitk_reduce_kernel")
        names.append("_add_rms_norm_kernel")
    return names + ["bf16_swap_kernel", "Memcpy DtoD", "_sample_kernel"]


def test_roles_follow_the_runner_structure():
    _, runner = _runner()
    names = _step_names(2, split_k_reduce_after_down=True)
    roles, matched = assign_roles(names, runner)
    assert matched
    products = [r for n, r in zip(names, roles) if "swap" in n]
    assert products == ["q/k/v", "o", "gate/up", "down"] * 2 + ["lm_head"]
    assert [r for n, r in zip(names, roles) if n == "_lora_a_kernel"] == \
        ["LoRA A q/k/v", "LoRA A o", "LoRA A gate/up", "LoRA A down"] * 2
    # the x rewrite goes with the product after it, the split-K reduce with the one before it
    assert [r for n, r in zip(names, roles) if n == "permute_x_kernel"] == ["gate/up"] * 2
    assert [r for n, r in zip(names, roles) if n == "_splitk_reduce_kernel"] == ["down"] * 2
    assert roles.count("attention") == 4 and roles.count("norm (+ residual)") == 5
    assert roles[-1] == "sampling" and roles[0] == "other"


def test_a_step_that_does_not_match_is_grouped_by_name_only():
    _, runner = _runner()
    names = _step_names(2)
    del names[names.index("nvfp4_swap_kernel")]  # one product too few for this model
    roles, matched = assign_roles(names, runner)
    assert not matched
    assert "q/k/v" not in roles  # products and their x rewrites are all just "matmul"
    assert roles.count("matmul") == sum("swap" in n or "permute" in n for n in names) == 10


def test_unfused_siblings_are_one_product_each():
    _, runner = _runner(fuse=False)
    names = _step_names(2)
    roles, matched = assign_roles(names, runner)
    assert not matched  # the step above launches fused groups; this runner launches q, k, v apart
    per_layer = ["_lora_a_kernel", "nvfp4_swap_kernel", "nvfp4_swap_kernel", "nvfp4_swap_kernel",
                 "_lora_a_kernel", "nvfp4_swap_kernel", "_lora_a_kernel", "nvfp4_swap_kernel", "nvfp4_swap_kernel",
                 "_lora_a_kernel", "nvfp4_swap_kernel"]
    roles, matched = assign_roles(per_layer * 2 + ["bf16_swap_kernel"], runner)
    assert matched
    assert roles[1:4] == ["q/k/v (0)", "q/k/v (1)", "q/k/v (2)"]


def test_bytes_count_every_weight_once_plus_the_cache_and_activations():
    model, runner = _runner()
    rows, attended = 3, 17
    b = role_bytes(runner, rows, attended)
    cfg = model.config
    L, D, e = cfg.num_hidden_layers, cfg.hidden_size, 4  # the tiny model runs in fp32
    qkv = [(m.self_attn.q_proj, m.self_attn.k_proj, m.self_attn.v_proj) for m in model.model.layers]
    weights = sum(t.numel() * t.element_size() for g in qkv for m in g
                  for t in [*m.quantized_tensors().values(), m.bias])
    n = sum(m.out_features for m in qkv[0])
    r = 3 * 4  # three stacked rank-4 adapters
    assert b["q/k/v"] == weights + L * (rows * D * e + rows * n * e + n * r * e + rows * r * e)
    assert b["LoRA A q/k/v"] == L * (r * D * e + rows * D * e + rows * r * e)
    hd, kv = D // cfg.num_attention_heads, cfg.num_key_value_heads
    assert b["attention"] == L * (rows * attended * kv * hd * e * 2 + 2 * rows * cfg.num_attention_heads * hd * e)
    head = model.lm_head.weight
    assert b["lm_head"] == head.numel() * e + rows * D * e + rows * cfg.vocab_size * e
    # a 4-bit product moves about 4.5 bits per weight, far less than its 16-bit form
    assert weights < sum(m.in_features * m.out_features for g in qkv for m in g) * 0.6


def test_role_table_charges_each_kernel_to_its_role_per_step():
    _, runner = _runner()
    names = _step_names(2)
    steps = 3
    names_durs = [(n, 2.0 if "swap" in n else 1.0) for _ in range(steps) for n in names]
    rows, matched = role_table(names_durs, steps, runner, rows=1, attended=9, copy_bw=1e12)
    assert matched
    by = {r["role"]: r for r in rows}
    assert by["q/k/v"]["calls"] == 2 and by["q/k/v"]["us"] == 4.0
    assert by["lm_head"]["calls"] == 1 and by["gate/up"]["us"] == 2 * (2.0 + 1.0)  # its x rewrite included
    assert abs(by["q/k/v"]["floor_pct"] - 100 * by["q/k/v"]["bytes"] / 1e12 / 4e-6) < 1e-9
    assert abs(sum(r["us"] for r in rows) - sum(d for _, d in names_durs) / steps) < 1e-9
    # steps that are not the same kernels: grouped by name, no bytes claimed
    rows, matched = role_table(names_durs[:-1] + [("other_kernel", 1.0)], steps, runner, 1, 9, 1e12)
    assert not matched and all("bytes" not in r for r in rows)


def test_busy_time_merges_overlapping_kernels():
    assert busy_us([("a", 0.0, 5.0), ("b", 3.0, 4.0), ("c", 10.0, 1.0)]) == 8.0
    assert busy_us([("a", 0.0, 5.0), ("b", 1.0, 1.0)]) == 5.0
    assert busy_us([]) == 0.0
    assert torch.isfinite(torch.tensor(busy_us([("a", 0.0, 0.0)])))


def test_a_norm_launch_that_does_lora_a_is_named_and_charged_for_both_halves():
    """A norm launch that also computes the next group's LoRA A product (`add_rms_norm_lora_a`) is named for
    both jobs and charged both halves' bytes; the plain norm before lm_head keeps its own role."""
    _, runner = _runner()
    names = _step_names(2)
    fused = []
    for i, n in enumerate(names):
        if n == "_lora_a_kernel" and names[i - 1] == "_add_rms_norm_kernel":
            fused[-1] = "_add_rms_norm_lora_a_kernel"  # the norm before q/k/v or gate/up now does their LoRA A
            continue
        fused.append(n)
    roles, matched = assign_roles(fused, runner)
    assert matched
    assert [r for r in roles if "LoRA A" in r] == ["norm + LoRA A q/k/v", "LoRA A o", "norm + LoRA A gate/up",
                                                  "LoRA A down"] * 2
    rows, _ = role_table([(n, 1.0) for n in fused], 1, runner, rows=2, attended=9, copy_bw=1e12)
    by = {r["role"]: r for r in rows}
    b = role_bytes(runner, 2, 9)
    norm_call = b["norm (+ residual)"] / 5
    assert by["norm + LoRA A q/k/v"]["bytes"] == norm_call * 2 + b["LoRA A q/k/v"]
    assert by["LoRA A down"]["bytes"] == b["LoRA A down"]
    assert by["norm (+ residual)"]["calls"] == 1 and by["norm (+ residual)"]["bytes"] == norm_call
