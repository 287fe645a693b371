"""GRPO / DAPO / Dr. GRPO losses and group advantages against hand-computed examples."""

import math

import pytest
import torch

from qerl.rl.advantages import group_advantages, mixed_groups, overlong_penalty
from qerl.rl.losses import LossSettings, k3_kl, loss_normalizer, policy_loss


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(r, 4)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6)
    torch.testing.assert_close(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4))  # equal rewards: no signal, no NaN
    torch.testing.assert_close(group_advantages(r, 4, scale=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.ones(6), 4)


def test_mixed_groups_and_overlong_penalty():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert mixed_groups(r, 2).tolist() == [False, True, False]
    lengths = torch.tensor([10, 12, 14, 16, 20])
    # max_len 16, buffer 4: 0 up to 12, then (12 - L)/4, -1 past 16
    torch.testing.assert_close(overlong_penalty(lengths, 16, 4), torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert overlong_penalty(lengths, 16, 0).abs().sum() == 0


def _example():
    # two sequences, lengths 2 and 3 (T = 3)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = torch.log(torch.tensor([[0.5, 0.5, 1.0], [0.2, 0.4, 0.5]]))
    new = torch.log(torch.tensor([[0.9, 0.5, 1.0], [0.2, 0.2, 0.6]]))  # ratios 1.8, 1 | 1, 0.5, 1.2
    adv = torch.tensor([1.0, -2.0])
    return mask, old, new, adv


def test_grpo_loss_by_hand():
    mask, old, new, adv = _example()
    s = LossSettings("grpo", 0.2, 0.2)
    logp = new.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, loss_normalizer(mask, s), s)
    # seq 0 (A=+1): min(1.8, 1.2) = 1.2 ; min(1, 1) = 1        -> mean 1.1
    # seq 1 (A=-2): min(-2, -2) = -2 ; min(-1, -1.6) = -1.6 ; min(-2.4, -2.4) = -2.4 -> mean -2.0
    assert loss.item() == pytest.approx(-(1.1 + -2.0) / 2, rel=1e-6)
    assert stats["clipped"].item() == 2  # 1.8 clipped to 1.2 (A>0), 0.5 clipped to 0.8 (A<0)
    assert stats["tokens"].item() == 5
    loss.backward()
    # gradient only through unclipped tokens: d/dlogp of -(w * r * A) = -w * r * A
    g = logp.grad
    assert g[0, 0] == 0 and g[1, 1] == 0 and g[0, 2] == 0
    assert g[0, 1].item() == pytest.approx(-(1 / 2) / 2 * 1.0 * 1.0)
    assert g[1, 2].item() == pytest.approx(-(1 / 3) / 2 * 1.2 * -2.0, rel=1e-5)


def test_dapo_loss_is_token_level_with_clip_higher():
    mask, old, new, adv = _example()
    s = LossSettings("dapo", 0.2, 0.28)
    loss, stats = policy_loss(new, old, adv, loss_normalizer(mask, s), s)
    # seq 0: min(1.8, 1.28) = 1.28, 1 ; seq 1: -2, min(-1, -1.6) = -1.6, -2.4 ; sum / 5 tokens
    assert loss.item() == pytest.approx(-(1.28 + 1 - 2 - 1.6 - 2.4) / 5, rel=1e-6)


def test_dr_grpo_uses_a_constant_normaliser():
    mask, old, new, adv = _example()
    s = LossSettings("dr_grpo", 0.2, 0.2, max_new_tokens=4)
    loss, _ = policy_loss(new, old, adv, loss_normalizer(mask, s), s)
    assert loss.item() == pytest.approx(-(1.2 + 1 - 2 - 1.6 - 2.4) / (2 * 4), rel=1e-6)


def test_k3_kl_and_beta():
    mask, old, new, adv = _example()
    ref = old.clone()
    kl = k3_kl(new, ref)
    d = ref - new
    torch.testing.assert_close(kl, torch.exp(d) - d - 1)
    assert (kl >= 0).all() and kl[0, 1] == 0
    s0, s1 = LossSettings("grpo", 0.2, 0.2, kl_beta=0.0), LossSettings("grpo", 0.2, 0.2, kl_beta=0.1)
    w = loss_normalizer(mask, s0)
    l0, _ = policy_loss(new, old, adv, w, s0, ref)
    l1, st = policy_loss(new, old, adv, w, s1, ref)
    assert l1.item() == pytest.approx(l0.item() + 0.1 * (w * kl).sum().item(), rel=1e-6)
    assert st["kl"].item() == pytest.approx((kl * mask).sum().item(), rel=1e-6)


def test_micro_batches_give_the_full_batch_gradient():
    torch.manual_seed(0)
    mask = torch.rand(6, 7) > 0.3
    mask[:, 0] = True
    old, adv = torch.randn(6, 7) * 0.1 - 2, torch.randn(6)
    for algo in ("grpo", "dapo", "dr_grpo"):
        s = LossSettings(algo, 0.2, 0.28, max_new_tokens=7)
        w = loss_normalizer(mask, s)
        full = (old + 0.05).clone().requires_grad_(True)
        policy_loss(full, old, adv, w, s)[0].backward()
        parts = (old + 0.05).clone().requires_grad_(True)
        for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
            policy_loss(parts[sl], old[sl], adv[sl], w[sl], s)[0].backward()
        torch.testing.assert_close(parts.grad, full.grad)


def test_tis_weights_scale_the_objective():
    mask, old, new, adv = _example()
    s = LossSettings("dapo", 0.2, 0.28)
    w = loss_normalizer(mask, s)
    tis = torch.full_like(old, 0.5)
    l_plain, _ = policy_loss(new, old, adv, w, s)
    l_tis, _ = policy_loss(new, old, adv, w, s, tis=tis)
    assert l_tis.item() == pytest.approx(0.5 * l_plain.item())
