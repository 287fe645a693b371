"""Where completions end: stop strings found in the decoded text, and each row's finish reason.

Stop strings are checked on the host from the decoded text: while decoding, every `check_every` steps
(`stop_string_rows`, which marks rows finished), and once at the end, where each row is cut right after
the first token whose text completes a stop string (`cut_at_stop_strings`). Tokens are decoded with their
special tokens (`skip_special_tokens=False`).
"""

from typing import Sequence

import torch


def decode_text(tokenizer, ids: list[int]) -> str:
    """The text of token ids, special tokens included."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def stop_string_rows(tokenizer, tokens: torch.Tensor, mask: torch.Tensor, stop: Sequence[str], Bb: int,
                     device) -> torch.Tensor:
    """tokens [n, t] int64, mask [n, t] bool (the completions so far) -> [Bb] bool on `device`: rows whose
    completion so far contains a stop string (one host copy; rows n..Bb-1 are False)."""
    hit = torch.zeros(Bb, dtype=torch.bool)
    for b, (t, m) in enumerate(zip(tokens.cpu(), mask.cpu())):
        text = decode_text(tokenizer, t[m].tolist())
        hit[b] = any(s in text for s in stop)
    return hit.to(device)


def cut_at_stop_strings(tokenizer, tokens: torch.Tensor, mask: torch.Tensor,
                        stop: Sequence[str]) -> tuple[torch.Tensor, list[bool]]:
    """Keep each row up to and including the first token whose text completes a stop string.
    tokens [B, T] int64, mask [B, T] bool. Returns the new mask [B, T] bool and which rows were cut."""
    mask, cut = mask.clone(), []
    for b, (t, m) in enumerate(zip(tokens.cpu(), mask.cpu())):
        ids = t[m].tolist()
        has_stop = lambda k: any(s in decode_text(tokenizer, ids[:k]) for s in stop)  # noqa: E731
        cut.append(has_stop(len(ids)))
        if not cut[-1]:
            continue
        lo, hi = 1, len(ids)  # smallest prefix holding a stop string; text grows with the prefix
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
        mask[b, lo:] = False
    return mask, cut


def finish_reasons(tokens: torch.Tensor, mask: torch.Tensor, cut: list[bool], eos_token_ids: Sequence[int],
                   ignore_eos: bool) -> list[str]:
    """tokens [B, T] int64, mask [B, T] bool -> per row "stop" where the row ended on EOS or was cut at a
    stop string, else "length"."""
    n = mask.sum(-1, keepdim=True)
    last = tokens.gather(1, (n - 1).clamp_min(0)).squeeze(1).tolist()
    eos = set() if ignore_eos else set(eos_token_ids)
    return ["stop" if (c or (k > 0 and tok in eos)) else "length"
            for c, k, tok in zip(cut, n.squeeze(1).tolist(), last)]
