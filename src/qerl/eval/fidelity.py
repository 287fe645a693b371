"""How far a quantized model's next-token distributions are from the 16-bit original's."""

import math

import torch

# A fixed, varied English + arithmetic sample (written for qerl) so the numbers are reproducible offline.
SAMPLE_TEXT = (
    "Natalie bought 3 boxes of pencils with 12 pencils in each box. She gave 7 pencils to her brother and "
    "split the rest equally between herself and two friends. How many pencils did each of them get? "
    "First, 3 boxes times 12 pencils is 36 pencils. After giving 7 away she has 29 left, which does not "
    "split evenly among three people, so she keeps the extra two. The river that runs past the old mill "
    "rises every spring, when the snow on the mountains melts and the farmers open the gates of the canal. "
    "In the evening the town square fills with people who come to hear the band play on the wooden stage."
)


@torch.no_grad()
def next_token_logprobs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids int64 [B, T] -> float32 log-probs [B, T, V] of the model's next-token distributions."""
    return torch.log_softmax(model(input_ids=input_ids).logits.float(), dim=-1)


def compare_logprobs(ref: torch.Tensor, new: torch.Tensor, input_ids: torch.Tensor) -> dict[str, float]:
    """Mean KL(ref || new) per position, top-1 agreement, and perplexity of the text under both.

    ref, new: float32 [B, T, V] log-probs; input_ids int64 [B, T].
    """
    kl = (ref.exp() * (ref - new)).sum(-1).mean().item()
    targets = input_ids[:, 1:].unsqueeze(-1)
    nll_ref = -ref[:, :-1].gather(-1, targets).mean().item()
    nll_new = -new[:, :-1].gather(-1, targets).mean().item()
    agree = (ref.argmax(-1) == new.argmax(-1)).float().mean().item()
    return {"kl": kl, "top1_agreement": agree, "ppl_ref": math.exp(nll_ref), "ppl_quant": math.exp(nll_new)}
