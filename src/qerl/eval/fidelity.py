"""How far a quantized model's next-token distributions are from the 16-bit original's."""

import math

import torch



def fidelity_text(n_problems: int = 8) -> str:
    """The first GSM8K test problems with their worked solutions: fixed, offline, in the RL domain
    (1,485 tokens for 8 problems with the SmolLM2 tokenizer)."""
    from ..data import gsm8k_test

    return "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in gsm8k_test()[:n_problems])


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
