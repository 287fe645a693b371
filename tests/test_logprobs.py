"""The chunked vocabulary projection (`qerl.rl.logprobs.chunked_token_logprobs`) equals the full one.

The loss pass never builds the whole [tokens, vocab] logits tensor: it projects chunks of positions and recomputes
each chunk in the backward. Values and gradients (hidden states and the lm_head weight) must match one full
`log_softmax` over the vocabulary, for chunk sizes that do not divide the token count, a sampling temperature,
and without autograd.
"""

import pytest
import torch

from qerl.rl.logprobs import chunked_token_logprobs


def full_token_logprobs(hidden, weight, targets, temperature):
    """The reference: one [B, T, V] fp32 logits tensor."""
    logits = (hidden.double() @ weight.double().T) / temperature
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("tokens_per_chunk", [1, 7, 13, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_values_and_gradients(tokens_per_chunk, temperature):
    g = torch.Generator().manual_seed(tokens_per_chunk * 10 + int(temperature * 10))
    B, T, D, V = 3, 11, 16, 97  # 33 positions: no chunk size above divides them
    hidden = torch.randn(B, T, D, generator=g).requires_grad_()
    weight = torch.randn(V, D, generator=g).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)

    chunk_bytes = 4 * V * tokens_per_chunk  # the function sizes chunks as fp32 rows of V logits
    got = chunked_token_logprobs(hidden, weight, targets, temperature, chunk_bytes=chunk_bytes)
    assert got.dtype == torch.float32 and got.shape == (B, T)
    (got * upstream).sum().backward()
    got_dh, got_dw = hidden.grad.clone(), weight.grad.clone()

    hidden.grad = weight.grad = None
    want = full_token_logprobs(hidden, weight, targets, temperature)
    (want * upstream.double()).sum().backward()

    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_dh, hidden.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_dw, weight.grad, rtol=1e-4, atol=1e-5)


def test_chunked_without_autograd_matches_and_keeps_no_graph():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 9, 8, generator=g), torch.randn(31, 8, generator=g)
    targets = torch.randint(0, 31, (2, 9), generator=g)
    with torch.no_grad():
        got = chunked_token_logprobs(hidden, weight, targets, 1.0, chunk_bytes=4 * 31 * 4)
    assert got.grad_fn is None
    torch.testing.assert_close(got.double(), full_token_logprobs(hidden, weight, targets, 1.0), rtol=1e-5, atol=1e-5)


def test_chunked_logprobs_of_bf16_hidden_states_are_fp32():
    """The policy's hidden states are bf16 on a GPU; the log-softmax must still run in fp32 (no bf16 rounding of
    logits, whose differences are what the loss reads)."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(1, 5, 8, generator=g).bfloat16(), torch.randn(40, 8, generator=g).bfloat16()
    targets = torch.randint(0, 40, (1, 5), generator=g)
    got = chunked_token_logprobs(hidden, weight, targets, 1.0, chunk_bytes=4 * 40 * 2)
    assert got.dtype == torch.float32
    # the reference rounds the product to bf16 as F.linear does, then works in float64
    logits = torch.nn.functional.linear(hidden, weight).double()
    want = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
