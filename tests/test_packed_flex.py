"""The FlexAttention form of the packed loss passes (`optim.packed_attention: flex`, `qerl.nn.packed_flex`) on the
CPU: its log-probs equal the padded path's and the SDPA form's on tiny real models (GQA, a sliding window, prompts
split over micro-batches); its layout covers the stream; what it refuses. FlexAttention's backward runs on CUDA only:
the gradients are checked against the padded path in tests/test_packing_gpu.py."""

import pytest
import torch
from test_packing import ALL_IN_ONE, SPLIT, assert_rel_close, make_batch, padded, policy
from tiny import tiny_model

from qerl.config import ConfigError, load_config
from qerl.models import quantize_model
from qerl.nn import LoraConfig
from qerl.nn.packed_attention import packed_attention_forward, packed_layout
from qerl.nn.packed_flex import flex_layout
from qerl.rl.packing import packed_logprobs, plan_micro_batches
from qerl.rl.settings import update_settings


def packed(model, batch, budget, attention):
    cid = batch[2]
    return torch.cat([packed_logprobs(model, mb, cid) for mb in plan_micro_batches(*batch, budget, attention)])


@pytest.mark.parametrize("budget", [ALL_IN_ONE, SPLIT])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_flex_log_probs_equal_the_padded_path_and_the_sdpa_form(arch, budget):
    model = policy(arch, "bf16")
    batch = make_batch(seed=3)
    with torch.no_grad():
        flex = packed(model, batch, budget, "flex")
        assert torch.isfinite(flex).all()
        assert_rel_close(flex, padded(model, batch), what="flex vs padded")
        assert_rel_close(flex, packed(model, batch, budget, "sdpa"), what="flex vs sdpa")


def test_flex_applies_the_sliding_window():
    model = quantize_model(tiny_model("mistral", sliding_window=3), "bf16", LoraConfig(r=4, alpha=8))
    batch = make_batch(seed=8)
    with torch.no_grad():
        assert_rel_close(packed(model, batch, SPLIT, "flex"), padded(model, batch), what="logp")


def test_a_flex_layout_covers_its_stream_and_says_who_reads_what():
    # a prompt of 3 at 0..2, two completions of 2 at 3..4 and 5..6 reading it
    layout = flex_layout([(0, 0, 0, 3), (0, 3, 3, 2), (0, 3, 5, 2)], "cpu")
    assert layout.own_start.tolist() == [0, 0, 0, 3, 3, 5, 5]
    assert layout.prefix_len.tolist() == [0, 0, 0, 3, 3, 3, 3]
    assert layout.position.tolist() == [0, 1, 2, 3, 4, 3, 4]
    q, k = torch.arange(7)[:, None], torch.arange(7)[None, :]
    seen = layout.mask_mod(None)(0, 0, q, k).int().tolist()
    assert seen == [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0],
                    [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0],  # the first completion: prompt + itself
                    [1, 1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 1]]  # the second: never its sibling
    with pytest.raises(ValueError, match="cover the stream"):
        flex_layout([(0, 0, 0, 3), (0, 3, 4, 2)], "cpu")  # token 3 belongs to no segment
    with pytest.raises(ValueError, match="overlap"):
        flex_layout([(0, 0, 0, 3), (0, 3, 2, 2)], "cpu")


def test_the_flex_form_refuses_sinks_a_cpu_backward_and_unknown_forms():
    layout = packed_layout([(0, 0, 0, 4)], "cpu", "flex")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="packed_attention: sdpa"):
        packed_attention_forward(None, q, q, q, None, qerl_packing=layout, s_aux=torch.zeros(2))
    grad = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="trains on CUDA only"):
        packed_attention_forward(None, grad, grad, grad, None, qerl_packing=layout)
    with pytest.raises(ValueError, match="unknown packed attention"):
        packed_layout([(0, 0, 0, 4)], "cpu", "flash")


def test_the_config_selects_the_form():
    assert update_settings(load_config(None, ["optim.packed_attention=flex"])).packed_attention == "flex"
    assert update_settings(load_config(None, [])).packed_attention == "sdpa"
    with pytest.raises(ConfigError, match="packed_attention"):
        load_config(None, ["optim.packed_attention=flash"])
