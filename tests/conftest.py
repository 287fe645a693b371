import os
import sys

import pytest
import torch

torch.set_num_threads(min(4, os.cpu_count() or 1))
_EXIT_STATUS = pytest.StashKey[int]()


GPU_SKIP_REASON = "needs CUDA; run on the GPU machine"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Without CUDA, report every GPU test's skip at one place (this file), so `-ra` folds them into one
    "SKIPPED [N] ... needs CUDA" line instead of one line per test function before the summary."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and isinstance(rep.longrepr, tuple) and rep.longrepr[2].endswith(GPU_SKIP_REASON):
        rep.longrepr = (__file__, None, rep.longrepr[2])


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process without the interpreter's teardown, once pytest has reported everything: Triton's
    nanobind bindings print dozens of "nanobind: leaked ..." lines at teardown after a session that compiled
    kernels (objects Triton keeps alive, not ours), which buried the summary."""
    if hasattr(config, "workerinput") or _EXIT_STATUS not in config.stash:
        return  # an xdist worker (its controller reports), or pytest stopped before the session ran
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Qwen2 (tied embeddings) + character tokenizer saved as a Hugging Face directory; read-only."""
    from tiny import tiny_model, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen2", dtype=torch.bfloat16).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d
