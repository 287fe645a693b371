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
