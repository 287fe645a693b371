"""Word overlap between an evaluation set and a training set: how much of each held-out question appears in
one training question (a cheap contamination check, docs/training.md "GSM8K offline").

A question's words are its lowercased alphanumeric tokens ([a-z0-9]+), as a set. For each held-out question
with word set H the score is max over training questions T of |H & T| / |H|: 1.0 when some training question
contains every one of its words (e.g. an exact duplicate), 0 when no training question shares a word. Numbers
and names count as words, so a template re-filled with other names and numbers scores below its source, but
still high: most of its words are the template's.

The scores are one matrix product of 0/1 word-incidence matrices over the held-out vocabulary (training words
that no held-out question has cannot raise a score), in blocks of training questions: 500 x 2,000 GSM8K-size
questions take well under a second on one CPU core.
"""

import re
from dataclasses import dataclass

import numpy as np

WORD = re.compile(r"[a-z0-9]+")
THRESHOLD = 0.5  # a held-out question sharing more than this share of its words with one training question
BLOCK = 4096  # training questions per matrix product


def words(text: str) -> frozenset[str]:
    """The set of lowercased alphanumeric tokens of `text`."""
    return frozenset(WORD.findall(text.lower()))


@dataclass
class Overlap:
    """Per held-out question i: scores[i] = the largest share of its words in one training question,
    best[i] = that training question's index (-1 when no training question shares a word)."""

    scores: np.ndarray  # float64 [n_heldout]
    best: np.ndarray  # int64 [n_heldout]
    threshold: float = THRESHOLD

    @property
    def above(self) -> int:
        return int((self.scores > self.threshold).sum())

    def summary(self, top: int = 5) -> dict:
        """n, above (count of scores > threshold), share_above, max, mean, and the `top` highest as
        [{"heldout": i, "train": j, "score": s}] (highest first, ties by held-out index)."""
        n = len(self.scores)
        order = sorted(range(n), key=lambda i: (-self.scores[i], i))[:top]
        return {"n": n, "threshold": self.threshold, "above": self.above,
                "share_above": self.above / n if n else 0.0,
                "max": float(self.scores.max()) if n else 0.0, "mean": float(self.scores.mean()) if n else 0.0,
                "top": [{"heldout": i, "train": int(self.best[i]), "score": float(self.scores[i])} for i in order]}


def max_overlap(heldout: list[str], train: list[str], threshold: float = THRESHOLD) -> Overlap:
    """For each held-out question, the largest share of its word set found in any single training question."""
    held_sets = [words(q) for q in heldout]
    vocab = {w: k for k, w in enumerate(sorted(set().union(*held_sets)))} if held_sets else {}
    n = len(held_sets)
    scores, best = np.zeros(n), np.full(n, -1, dtype=np.int64)
    if not n or not vocab or not train:
        return Overlap(scores, best, threshold)
    H = _incidence(held_sets, vocab)  # [n, V]
    sizes = np.maximum(H.sum(axis=1), 1.0)
    for start in range(0, len(train), BLOCK):
        block = [words(q) for q in train[start:start + BLOCK]]
        shared = H @ _incidence(block, vocab).T  # [n, block]: words in common (exact small integers in float32)
        j = shared.argmax(axis=1)
        s = shared[np.arange(n), j] / sizes
        better = s > scores
        scores[better], best[better] = s[better], j[better] + start
    return Overlap(scores, best, threshold)


def _incidence(sets: list[frozenset[str]], vocab: dict[str, int]) -> np.ndarray:
    m = np.zeros((len(sets), len(vocab)), dtype=np.float32)
    for i, s in enumerate(sets):
        cols = [vocab[w] for w in s if w in vocab]
        m[i, cols] = 1.0
    return m


def format_summary(result: Overlap, heldout: list[str] | None = None, train: list[str] | None = None,
                   top: int = 3, width: int = 100) -> str:
    """A few lines for a log: the counts, then the top examples (with their text when the questions are given)."""
    s = result.summary(top)
    lines = [f"{s['above']} of {s['n']} held-out questions ({100 * s['share_above']:.1f}%) share more than "
             f"{s['threshold']:g} of their words with one training question; max {s['max']:.2f}, "
             f"mean {s['mean']:.2f}"]
    for t in s["top"]:
        lines.append(f"  {t['score']:.2f}  held-out #{t['heldout']} ~ train #{t['train']}")
        if heldout is not None and train is not None and t["train"] >= 0:
            lines.append(f"        held-out: {_clip(heldout[t['heldout']], width)}")
            lines.append(f"        train:    {_clip(train[t['train']], width)}")
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."
