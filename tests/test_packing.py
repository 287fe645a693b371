"""Packed, shared-prefix loss passes (qerl.rl.packing) against the padded reference path: log-probs, LoRA
gradients and whole policy updates, on tiny random Llama / Qwen2 / Qwen3 models over bf16, NF4 and NVFP4
bases, with AQN noise and gradient checkpointing."""

import dataclasses

import pytest
import torch
from tiny import tiny_model

from qerl.models import lora_parameters, quantize_model
from qerl.models.policy import enable_gradient_checkpointing
from qerl.nn import LoraConfig
from qerl.nn.noisy_norm import NoisyNorms
from qerl.nn.packed_attention import ATTN_NAME
from qerl.rl.collect import Experience
from qerl.rl.logprobs import completion_logprobs
from qerl.rl.losses import LossSettings
from qerl.rl.packing import needed_tokens, packed_logprobs, plan_micro_batches, prompt_groups
from qerl.rl.update import UpdateSettings, policy_update

P, T = 7, 6
# (prompt length, loss tokens per row): prompts of different lengths, a full-length row, a 1-token completion,
# a row with an all-False mask, and a group whose rows all reach max length (truncated)
GROUPS = [(5, [T, 1, 0]), (3, [4, 2]), (P, [T, T, T])]
ALL_IN_ONE = 1000  # a budget that holds the whole batch
SPLIT = 20  # cuts group (3, ...) and group (7, ...) across micro-batches (see test_plan_...)


def make_batch(seed: int = 0, groups=GROUPS):
    """prompt_ids / prompt_mask [N, P] left-padded, completion_ids [N, T], completion_mask [N, T] (prefixes)."""
    g = torch.Generator().manual_seed(seed)
    pid, pm, lcs = [], [], []
    for lp, lc in groups:
        prompt = torch.randint(3, 150, (lp,), generator=g)
        for n in lc:
            pid.append(torch.cat([torch.zeros(P - lp, dtype=torch.long), prompt]))
            pm.append(torch.arange(P) >= P - lp)
            lcs.append(n)
    cid = torch.randint(3, 150, (len(lcs), T), generator=g)
    return torch.stack(pid), torch.stack(pm), cid, torch.arange(T)[None] < torch.tensor(lcs)[:, None]


def policy(arch: str, fmt: str, dropout: float = 0.0, checkpointing: bool = False):
    """A tiny fp32 model, `fmt` base + LoRA with a non-zero adapter (B = 0 would leave A without gradient)."""
    model = quantize_model(tiny_model(arch), fmt, LoraConfig(r=4, alpha=8, dropout=dropout))
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    if checkpointing:
        enable_gradient_checkpointing(model)
        model.train()  # checkpointing replays layers only in training mode
    return model


def padded(model, batch):
    return completion_logprobs(model, *batch)


def packed(model, batch, budget):
    cid = batch[2]
    return torch.cat([packed_logprobs(model, mb, cid) for mb in plan_micro_batches(*batch, budget)])


def logp_and_grads(model, fn, weights):
    model.zero_grad(set_to_none=True)
    logp = fn()
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in lora_parameters(model).items()}


def assert_rel_close(a, b, rel=1e-5, what=""):
    scale = b.abs().max().clamp(min=1e-30)
    assert (a - b).abs().max() <= rel * scale, f"{what}: max diff {(a - b).abs().max():.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("fmt", ["bf16", "nf4", "nvfp4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_packed_log_probs_and_lora_gradients_equal_the_padded_path(arch, fmt):
    model = policy(arch, fmt)
    batch = make_batch()
    weights = torch.randn(batch[3].shape, generator=torch.Generator().manual_seed(1))
    with NoisyNorms(model, 0.05, seed=0):  # AQN on: the same noise for both paths
        ref, ref_g = logp_and_grads(model, lambda: padded(model, batch), weights)
        for budget in (ALL_IN_ONE, SPLIT):
            got, got_g = logp_and_grads(model, lambda: packed(model, batch, budget), weights)
            assert_rel_close(got, ref, what=f"logp budget {budget}")
            assert torch.equal(got == 0, ref == 0) and torch.equal(got[~batch[3]], torch.zeros_like(got[~batch[3]]))
            for n in ref_g:
                assert ref_g[n].abs().max() > 0, n
                assert_rel_close(got_g[n], ref_g[n], what=f"{n} budget {budget}")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gradient_checkpointing_recomputes_under_the_packed_attention(arch):
    """The backward replays each decoder layer after the forward restored the attention implementation; the
    replay must run the packed attention again (else it attends across the whole stream: other gradients)."""
    batch = make_batch(seed=2)
    weights = torch.randn(batch[3].shape, generator=torch.Generator().manual_seed(3))
    plain = policy(arch, "nvfp4")
    ref, ref_g = logp_and_grads(plain, lambda: padded(plain, batch), weights)
    model = policy(arch, "nvfp4", checkpointing=True)
    config, funcs = model.config, [m._gradient_checkpointing_func for m in model.model.layers]
    got, got_g = logp_and_grads(model, lambda: packed(model, batch, SPLIT), weights)
    assert_rel_close(got, ref, what="logp")
    for n in ref_g:
        assert_rel_close(got_g[n], ref_g[n], what=n)
    assert config._attn_implementation == "sdpa" and ATTN_NAME not in str(config._attn_implementation)
    assert [m._gradient_checkpointing_func for m in model.model.layers] == funcs  # restored after the forward


def test_the_attention_implementation_is_restored_after_an_exception():
    model = policy("llama", "bf16")
    batch = list(make_batch())
    batch[2] = batch[2].clone()
    batch[2][0, 0] = 10_000  # outside the vocabulary: the embedding raises inside the packed forward
    mb = plan_micro_batches(*batch, ALL_IN_ONE)[0]
    with pytest.raises(IndexError):
        packed_logprobs(model, mb, batch[2])
    assert model.config._attn_implementation == "sdpa"
    assert torch.isfinite(padded(model, make_batch())).all()


def test_a_completion_sees_its_prompt_and_itself_only():
    """Perturbing a sibling's completion (before or after it in the stream) or another group's prompt leaves a
    row's log-probs as they were; perturbing the row's own prompt or completion changes them (so the checks
    can fail). Rows 5, 6, 7 are the full-length group."""
    model = policy("qwen2", "nvfp4")
    batch = make_batch()
    noise = torch.randint(3, 150, (T,), generator=torch.Generator().manual_seed(9))

    def perturbed(tensor: int, rows, cols=slice(None)):
        b = [t.clone() for t in batch]
        b[tensor][rows, cols] = noise[: b[tensor].shape[1]][cols]
        with torch.no_grad():
            return packed(model, b, ALL_IN_ONE)

    with torch.no_grad():
        base = packed(model, batch, ALL_IN_ONE)
    same = dict(rtol=0, atol=1e-6)
    first, last = perturbed(2, 5), perturbed(2, 7)  # completions of the group's first and last rows
    torch.testing.assert_close(first[6:8], base[6:8], **same)  # later siblings do not see row 5
    torch.testing.assert_close(last[5:7], base[5:7], **same)  # earlier siblings do not see row 7
    assert not torch.allclose(first[5, 1:], base[5, 1:]) and not torch.allclose(last[7, 1:], base[7, 1:])
    other = perturbed(0, slice(3, 5), slice(-3, None))  # the (3, ...) group's prompt, rows 3 and 4
    torch.testing.assert_close(other[:3], base[:3], **same)
    torch.testing.assert_close(other[5:], base[5:], **same)
    assert not torch.allclose(other[3], base[3])
    own = perturbed(0, slice(5, 8), slice(-2, None))  # the full-length group's own prompt
    assert not torch.allclose(own[5:8], base[5:8])


def test_plan_cuts_by_tokens_groups_by_prompt_and_counts_tokens():
    pid, pm, cid, cm = batch = make_batch()
    assert prompt_groups(pid, pm) == [0, 0, 0, 1, 1, 2, 2, 2]
    one = plan_micro_batches(*batch, ALL_IN_ONE)
    assert len(one) == 1 and one[0].rows == slice(0, 8)
    # each prompt once + loss tokens: 5 + 7, 3 + 6, 7 + 18
    assert one[0].computed_tokens == one[0].needed_tokens == 46 == needed_tokens(pid, pm, cm)
    split = plan_micro_batches(*batch, SPLIT)
    assert [mb.rows for mb in split] == [slice(0, 4), slice(4, 6), slice(6, 8)]
    assert [mb.computed_tokens for mb in split] == [19, 3 + 2 + 7 + 6, 7 + 12]  # prompts repeated where split
    assert sum(mb.needed_tokens for mb in split) == 46 and all(mb.computed_tokens <= SPLIT for mb in split)
    tiny = plan_micro_batches(*batch, 4)  # every row over the budget: one micro-batch each (the empty row joins one)
    assert [mb.rows for mb in tiny] == [slice(0, 1), slice(1, 3), *[slice(i, i + 1) for i in range(3, 8)]]
    # groups are found by their real tokens, not by a fixed G, and the padding width does not matter
    wide = (torch.cat([torch.zeros(8, 2, dtype=torch.long), pid], 1),
            torch.cat([torch.zeros(8, 2, dtype=torch.bool), pm], 1))
    assert prompt_groups(*wide) == prompt_groups(pid, pm)
    with pytest.raises(ValueError, match="prefix"):
        plan_micro_batches(pid, pm, cid, cm.flip(1), ALL_IN_ONE)


def test_prompt_shared_by_a_group_costs_it_once():
    """G = 8 completions of 24 tokens on 4 prompts of 40: computed stays within 5% of needed when groups are
    not split, and the padded path forwards far more."""
    groups = [(P, [T] * 8) for _ in range(4)]
    pid, pm, cid, cm = make_batch(groups=groups)
    plan = plan_micro_batches(pid, pm, cid, cm, 8 * T + P)  # one group per micro-batch
    computed, needed = sum(mb.computed_tokens for mb in plan), sum(mb.needed_tokens for mb in plan)
    assert len(plan) == 4 and computed <= 1.05 * needed and needed == 4 * P + 32 * T
    assert pid.numel() + cid.numel() > 1.5 * computed  # the padded forward repeats each prompt 8 times


def _experience(batch, seed=0) -> Experience:
    pid, pm, cid, cm = batch
    g = torch.Generator().manual_seed(seed)
    n = pid.shape[0]
    return Experience(pid, pm, cid, cm, sampling_logp=-torch.rand(n, T, generator=g) * 3, entropies=torch.zeros(n, T),
                      rewards=torch.zeros(n), advantages=torch.randn(n, generator=g), lengths=cm.sum(1),
                      truncated=cm.all(1))


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_policy_update_with_packing_equals_the_padded_update(algo):
    """KL to the reference (LoRA off), two updates (old log-probs pass), TIS, gradient checkpointing."""
    exp = _experience(make_batch(seed=4))
    base = UpdateSettings(LossSettings(algo, 0.2, 0.28, 0.05, T), num_updates=2, micro_batch_size=3,
                          max_grad_norm=1e9, tis_cap=2.0)
    results = []
    for s in (dataclasses.replace(base, packing=False), dataclasses.replace(base, max_tokens_per_micro_batch=SPLIT)):
        model = policy("llama", "nvfp4", checkpointing=True)
        params = lora_parameters(model)
        before = {k: v.detach().clone() for k, v in params.items()}
        opt = torch.optim.SGD(params.values(), lr=0.5)
        stats = policy_update(model, exp, opt, list(params.values()), s)
        results.append((stats, {k: v.detach().clone() for k, v in params.items()},
                        {k: v.grad.clone() for k, v in params.items()}, before))
    (pad, pad_p, pad_g, before), (pack, pack_p, pack_g, _) = results
    for k in ("loss", "clip_fraction", "ratio_mean", "kl", "tis_weight_mean", "grad_norm"):
        assert pack[k] == pytest.approx(pad[k], rel=1e-5, abs=1e-8), k
    for k in pad_p:  # the last update's gradients, and the parameters after both (which moved)
        assert not torch.equal(pad_p[k], before[k]), k
        assert_rel_close(pack_g[k], pad_g[k], what=k)
        assert_rel_close(pack_p[k], pad_p[k], rel=1e-6, what=k)
    assert pack["loss_tokens_needed"] == pad["loss_tokens_needed"] == 46
    assert pack["loss_tokens_computed"] == 19 + 18 + 19 and pad["loss_tokens_computed"] == 8 * (P + T)


def test_a_batch_without_loss_tokens_updates_as_the_padded_path_does():
    """Every row masked (e.g. all truncated under the overlong filter): no packed forward at all, a zero
    gradient, and AdamW's step (weight decay) the same as the padded path's."""
    pid, pm, cid, cm = make_batch(seed=5)
    exp = _experience((pid, pm, cid, torch.zeros_like(cm)))
    results = []
    for packing in (False, True):
        model = policy("llama", "nvfp4")
        params = lora_parameters(model)
        opt = torch.optim.AdamW(params.values(), lr=0.1, weight_decay=0.5)
        s = UpdateSettings(LossSettings("dapo"), packing=packing)
        stats = policy_update(model, exp, opt, list(params.values()), s)
        assert stats["grad_norm"] == 0 and stats["loss_tokens_needed"] == 0
        results.append({k: v.detach().clone() for k, v in params.items()})
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=0, atol=0)


def test_lora_dropout_trains_with_packing():
    """Dropout runs inside the packed forward (train mode: two passes differ) and an update moves the adapter."""
    exp = _experience(make_batch(seed=6))
    model = policy("qwen3", "nvfp4", dropout=0.2, checkpointing=True)
    plan = plan_micro_batches(exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask, SPLIT)
    with torch.no_grad():
        a, b = (packed_logprobs(model, plan[0], exp.completion_ids) for _ in range(2))
    assert not torch.equal(a, b)
    params = lora_parameters(model)
    before = {k: v.detach().clone() for k, v in params.items()}
    s = UpdateSettings(LossSettings("grpo"), max_tokens_per_micro_batch=SPLIT, max_grad_norm=1e9)
    stats = policy_update(model, exp, torch.optim.SGD(params.values(), lr=0.5), list(params.values()), s)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values()) and stats["grad_norm"] > 0
    assert all(not torch.equal(params[k], before[k]) for k in params)


def test_sliding_window_attention_matches_the_padded_path():
    """Mistral's sliding window (3 tokens here, shorter than the sequences) is applied inside the packed mask."""
    model = quantize_model(tiny_model("mistral", sliding_window=3), "bf16", LoraConfig(r=4, alpha=8))
    batch = make_batch(seed=8)
    with torch.no_grad():
        assert_rel_close(packed(model, batch, SPLIT), padded(model, batch), what="logp")


def test_the_config_sets_packing_and_its_budget():
    from qerl.config import ConfigError, load_config
    from qerl.rl.settings import update_settings

    default = update_settings(load_config(None))
    assert default.packing and default.max_tokens_per_micro_batch == 8192  # no model to size it by
    s = update_settings(load_config(None, ["optim.packing=false", "optim.max_tokens_per_micro_batch=1234"]))
    assert not s.packing and s.max_tokens_per_micro_batch == 1234
    with pytest.raises(ConfigError, match="optim.max_tokens_per_micro_batch must be > 0"):
        load_config(None, ["optim.max_tokens_per_micro_batch=0"])


@pytest.mark.parametrize("dim", [0, 1])
def test_gather_backward_equals_autograd_of_plain_indexing(dim):
    """Gather's gather-only backward sums the duplicate readers exactly like autograd's scatter-add; rows left
    out of the inverse must get zero gradient, so the upstream gradient is zeroed there."""
    from qerl.nn.packed_attention import host_gather

    g = torch.Generator().manual_seed(0)
    size, rows = 11, 40
    index = torch.randint(0, size, (rows,), generator=g)
    index[:3] = 4  # a position read many times
    read = torch.rand(rows, generator=g) > 0.3
    shape = (size, 3, 5) if dim == 0 else (2, size, 5)
    x = torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
    upstream = torch.randn(*(rows if d == dim else n for d, n in enumerate(shape)), dtype=torch.float64, generator=g)
    upstream = upstream * read.view(*(rows if d == dim else 1 for d in range(len(shape)))).double()
    gather = host_gather(index, size, "cpu", read)
    out = gather(x, dim)
    assert torch.equal(out, x.index_select(dim, index))
    (grad,) = torch.autograd.grad((out * upstream).sum(), x)
    (ref,) = torch.autograd.grad((x.index_select(dim, index) * upstream).sum(), x)
    torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-12)
    assert gather.inverse.shape == (size, int(torch.bincount(index[read], minlength=size).max()))


def test_inverse_index_of_a_permutation_is_its_inverse():
    from qerl.nn.packed_attention import inverse_index

    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    inv = inverse_index(perm, 9)
    assert inv.shape == (9, 1) and torch.equal(perm[inv[:, 0]], torch.arange(9))
    assert inverse_index(torch.zeros(0, dtype=torch.long), 0).shape == (0, 1)


def test_the_default_token_budget_follows_the_model_size():
    """null: ~6 GiB of checkpointed activations (4 x layers x hidden bytes a token) within [8192, 16384]."""
    from qerl.bench.rollout import qwen25_config
    from qerl.config import load_config
    from qerl.rl.packing import token_budget
    from qerl.rl.settings import update_settings

    budgets = {size: token_budget(qwen25_config(size)) for size in ("1.5b", "7b", "14b", "72b")}
    assert budgets == {"1.5b": 16384, "7b": 15360, "14b": 8192, "72b": 8192}
    tiny = tiny_model("llama").config
    assert update_settings(load_config(None), tiny).max_tokens_per_micro_batch == 16384
    pinned = load_config(None, ["optim.max_tokens_per_micro_batch=2048"])
    assert update_settings(pinned, tiny).max_tokens_per_micro_batch == 2048
