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


def _random_segments(seed: int, groups: int) -> list[tuple[int, int, int, int]]:
    """A packed stream as plan_micro_batches lays it out: per group its prompt, then its completions reading it."""
    g = torch.Generator().manual_seed(seed)
    segments, at = [], 0
    for _ in range(groups):
        prompt = int(torch.randint(1, 40, (1,), generator=g))
        segments.append((0, 0, at, prompt))
        start, at = at, at + prompt
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            n = int(torch.randint(1, 60, (1,), generator=g))
            segments.append((start, prompt, at, n))
            at += n
    return segments


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("seed,groups,block,chunk", [(0, 3, 16, 1 << 26), (1, 9, 16, -3), (2, 6, 32, 1),
                                                     (3, 1, 128, 1 << 26), (5, 12, 16, -4)])
def test_the_block_mask_is_create_block_masks(monkeypatch, seed, groups, block, chunk, window):
    """Tile for tile the tables torch's own create_block_mask (eager) builds from the same mask_mod, partial and
    full, kv and q sides, for streams that are and are not multiples of the block, in one chunk, one query block a
    chunk, or several blocks a chunk with a shorter last one."""
    from torch.nn.attention.flex_attention import create_block_mask

    import qerl.nn.packed_flex as pf

    layout = flex_layout(_random_segments(seed, groups), "cpu")
    if chunk < 0:  # -n: n query blocks per chunk, the last chunk shorter (as a long stream is built)
        chunk = layout.length * block * -chunk
        assert -(-layout.length // block) % (chunk // (layout.length * block)) != 0
    monkeypatch.setattr(pf, "MASK_CHUNK_ELEMENTS", chunk)
    ours = layout.block_mask(window, block)
    ref = create_block_mask(layout.mask_mod(window), None, None, layout.length, layout.length, device="cpu",
                            BLOCK_SIZE=block, _compile=False)
    assert ours.seq_lengths == ref.seq_lengths == (layout.length, layout.length)
    for count, index in [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                         ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")]:
        n_ours, n_ref = getattr(ours, count), getattr(ref, count)
        assert torch.equal(n_ours, n_ref), count
        i_ours, i_ref = getattr(ours, index), getattr(ref, index)
        for row in range(n_ref.shape[-1]):
            k = int(n_ref[0, 0, row])
            assert torch.equal(i_ours[0, 0, row, :k], i_ref[0, 0, row, :k]), (index, row)
    assert int(ours.kv_num_blocks.sum()) > 0
    if block == 16 and window is None:  # segments of up to 60 tokens fill some 16 x 16 tiles whole
        assert int(ours.full_kv_num_blocks.sum()) > 0
    assert layout.block_mask(window, block) is ours  # built once, then reused


def test_the_block_mask_sees_exactly_the_mask():
    """Expanded back to pairs, the tiles give the dense mask: hidden tiles all hidden, full ones all visible."""
    layout = flex_layout(_random_segments(4, 5), "cpu")
    block = 16
    partial, full = layout.block_tiles(None, block)
    L = layout.length
    q, k = torch.arange(L)[:, None], torch.arange(L)[None, :]
    dense = layout.mask_mod(None)(0, 0, q, k)
    tile = lambda t: t.repeat_interleave(block, 0).repeat_interleave(block, 1)[:L, :L]
    assert not (dense & ~tile(partial | full)).any()  # nothing visible in a skipped tile
    assert full.any() and dense[tile(full)].all()  # a full tile is all visible
    assert not (partial & full).any()
