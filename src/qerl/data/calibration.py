"""Calibration text for the calibrated quantization methods (gptq, awq): token ids [S, T], offline.

Sources (`model.calibration.source`, `qerl quantize --calibration`):
  reasoning-gym  a mixture of reasoning-gym arithmetic tasks at their own default settings, each problem
                 written as a chat turn (question + the GSM8K answer-format suffix) and answered by its
                 reference answer; seeds apart from the train/test draws of `qerl.data.load_problems`.
  self           the same prompts answered by the model's own greedy completions (needs the 16-bit
                 model whole; `qerl.models.calibration` generates them); self:FILE takes the prompts of a
                 question/answer JSONL instead.
  train          the run's own training prompts (`qerl train` only), answered as for reasoning-gym.
  FILE           a .txt file (paragraphs) or a .jsonl with "text" or question/answer rows.
  auto           the measured best for the situation (see `resolve_source`).
GSM8K test is qerl's evaluation set and reasoning-gym's `gsm_symbolic` is generated from GSM8K *test*
templates: neither is ever used for calibration.
"""

import json
import random
from pathlib import Path
from typing import Callable

import torch

from .templates import GSM8K_SUFFIX

SOURCES = ("auto", "reasoning-gym", "self", "train")
# Tasks with large problem spaces, so that a draw hardly ever equals an evaluation problem.
MIXTURE_TASKS = ("basic_arithmetic", "chain_sum", "products", "decimal_arithmetic", "fraction_simplification",
                 "gcd", "lcm", "leg_counting", "time_intervals", "prime_factorization")
CALIBRATION_SEED = 7_000_001  # apart from train (seed) and test (seed + 1,000,003) draws
MIN_TOKENS = 1024
TOKENS_PER_PROBLEM = 40  # a lower bound with a chat template: problems to draw for samples x max_tokens
TOKENS_PER_COMPLETION = 120  # the model's own answers are longer than reference answers
EVAL_ONLY = ("gsm8k-offline", "gsm8k", "aime2025", "reasoning-gym:gsm_symbolic")


class CalibrationError(ValueError):
    """A calibration source that cannot be used; the message names it."""


def mixture_problems(n: int, seed: int = CALIBRATION_SEED) -> list[dict]:
    """n reasoning-gym problems {"question", "answer", "task"}, tasks interleaved round-robin."""
    import reasoning_gym

    per_task = -(-n // len(MIXTURE_TASKS))
    pools = [[{"question": e["question"], "answer": str(e["answer"]), "task": t}
              for e in reasoning_gym.create_dataset(t, size=per_task, seed=seed + i)]
             for i, t in enumerate(MIXTURE_TASKS)]
    return [pools[i % len(pools)][i // len(pools)] for i in range(n)]


def chat_text(question: str, answer: str, tokenizer) -> str:
    """One problem as the model sees it in RL: user turn with the suffix, assistant turn with the answer."""
    user = f"{question.strip()}\n{GSM8K_SUFFIX}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], tokenize=False)
    return f"{user}\n{answer}\n"


def problem_answer_text(row: dict) -> str:
    """A reference answer written as a short worked answer in the suffix's format."""
    return f"The answer is {row['answer']}.\n#### {row['answer']}"


def file_texts(path: Path, tokenizer) -> list[str]:
    """Texts from a .txt file (blank-line separated paragraphs, used as they are) or a .jsonl file whose rows
    carry "text" (as is) or question/answer (written as a chat turn, like the reasoning-gym source)."""
    if not path.is_file():
        raise CalibrationError(f"calibration source {path}: no such file")
    if path.suffix.lower() != ".jsonl":
        return [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    texts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise CalibrationError(f"calibration source {path}: line {i} is not JSON") from None
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            texts.append(row["text"])
        elif isinstance(row, dict) and "question" in row and "answer" in row:
            texts += problem_texts([row], tokenizer)
        else:
            raise CalibrationError(f"calibration source {path}: line {i} has neither 'text' nor question/answer")
    return texts


def file_rows(path: Path) -> list[dict]:
    """question/answer rows of a JSONL file (for "self:FILE": its prompts, answered by the model)."""
    if not path.is_file():
        raise CalibrationError(f"calibration source {path}: no such file")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows or not all(isinstance(r, dict) and "question" in r for r in rows):
        raise CalibrationError(f"calibration source {path}: expected JSONL rows with a 'question'")
    return rows


def pack_tokens(texts: list[str], tokenizer, samples: int, max_tokens: int, where: str,
                seed: int = CALIBRATION_SEED) -> torch.Tensor:
    """Shuffle texts, tokenize, join with EOS and cut into at most `samples` rows of `max_tokens`: int64 [S, T].

    Fewer rows when the text runs out; CalibrationError when it gives fewer than MIN_TOKENS tokens."""
    if not texts:
        raise CalibrationError(f"calibration source {where}: empty")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for i in order:
        ids += tokenizer(texts[i], add_special_tokens=False)["input_ids"] + sep
        if len(ids) >= samples * max_tokens:
            break
    rows = min(samples, len(ids) // max_tokens)
    if rows * max_tokens < MIN_TOKENS:
        raise CalibrationError(f"calibration source {where}: {len(ids)} tokens, fewer than the {MIN_TOKENS} needed "
                               f"for one calibration pass ({samples} x {max_tokens} requested)")
    return torch.tensor(ids[:rows * max_tokens], dtype=torch.long).reshape(rows, max_tokens)


def check_source(source: str) -> None:
    """Refuse evaluation sets by name before any work is done."""
    if source in EVAL_ONLY or source.startswith("gsm8k"):
        raise CalibrationError(f"calibration source {source!r} is an evaluation set; calibrating on it would "
                               f"leak into the scores. Use one of {', '.join(SOURCES)} or a file")
    if source.startswith("self:"):
        return check_source(source.partition(":")[2] or "self")
    if source not in SOURCES and not Path(source).suffix:
        raise CalibrationError(f"unknown calibration source {source!r}; choose one of {', '.join(SOURCES)} "
                               "or a .txt/.jsonl file")


def problem_texts(rows: list[dict], tokenizer, answers: list[str] | None = None) -> list[str]:
    """Chat texts for problems, answered by `answers` (e.g. the model's completions) or by reference."""
    answers = answers or [problem_answer_text(r) for r in rows]
    return [chat_text(r["question"], a, tokenizer) for r, a in zip(rows, answers)]


def calibration_texts(source: str, tokenizer, samples: int, max_tokens: int, *,
                      answer: Callable[[list[dict]], list[str]] | None = None,
                      train_rows: list[dict] | None = None) -> list[str]:
    """The texts of a source, enough for `samples` x `max_tokens` tokens once packed (`pack_tokens`).

    answer(rows) -> the 16-bit model's answers to question rows (sources "self" and "self:FILE"; None where the
    model is not loaded whole); train_rows: the run's training problems (source "train", and added to "auto")."""
    check_source(source)
    n_problems = samples * max_tokens // TOKENS_PER_PROBLEM
    if source == "auto":
        return problem_texts(mixture_problems(n_problems) + (train_rows or [])[:n_problems], tokenizer)
    if source == "reasoning-gym":
        return problem_texts(mixture_problems(n_problems), tokenizer)
    if source == "self" or source.startswith("self:"):
        if answer is None:
            raise CalibrationError("calibration source 'self' needs the 16-bit model loaded whole (not streamed)")
        n_self = samples * max_tokens // TOKENS_PER_COMPLETION
        path = source.partition(":")[2]
        rows = mixture_problems(n_self) if not path else file_rows(Path(path))[:n_self]
        return problem_texts(rows, tokenizer, answer(rows))
    if source == "train":
        if not train_rows:
            raise CalibrationError("calibration source 'train' is the run's training prompts: only for qerl train")
        return problem_texts(train_rows[:n_problems], tokenizer)
    return file_texts(Path(source), tokenizer)
