import os

import pytest
import torch

torch.set_num_threads(min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Qwen2 (tied embeddings) + character tokenizer saved as a Hugging Face directory; read-only."""
    from tiny import tiny_model, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen2", dtype=torch.bfloat16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d
