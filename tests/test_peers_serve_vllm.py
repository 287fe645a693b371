"""benchmarks/peers/serve_vllm.py on the CPU with a tiny random model (no vLLM here): the qerl way scores the adapter
as `qerl eval` does, the vLLM way's merged model is made and its failure to import vLLM is a table row, not a crash;
scoring of texts."""

import json
import subprocess
import sys

import torch

from bench_scripts import ROOT, load_peer

from qerl.models import load_causal_lm, quantize_model, save_adapter
from qerl.nn import LoraConfig


def test_qerl_way_scores_and_a_missing_vllm_is_a_row(tiny_dir, tmp_path):
    model, _ = load_causal_lm(str(tiny_dir))
    save_adapter(quantize_model(model, "nvfp4", LoraConfig(r=4, alpha=8)), tmp_path / "adapter",
                 base_model_name_or_path=str(tiny_dir))
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+1=?", "answer": str(a + 1)}) + "\n" for a in range(3)))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/peers/serve_vllm.py"), "--model",
                           str(tiny_dir), "--adapter", str(tmp_path / "adapter"), "--test", str(data),
                           "--suffix", "none", "--limit", "2", "--max-new-tokens", "8", "--ways",
                           "qerl-16bit,vllm-merged,vllm-merged-fp32,vllm-16bit-lora", "--workdir",
                           str(tmp_path / "work"), "--out", str(tmp_path / "serve.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ways = json.loads((tmp_path / "serve.json").read_text())["ways"]
    evaluated = [json.loads(line) for line in (tmp_path / "work" / "qerl-16bit.jsonl").read_text().splitlines()]
    assert ways["qerl-16bit"]["pass1"] == sum(r["rewards"][0] for r in evaluated) / 2
    assert (tmp_path / "work" / "merged" / "config.json").is_file()
    from safetensors import safe_open

    fp32 = tmp_path / "work" / "merged_fp32"
    with safe_open(str(next(fp32.glob("*.safetensors"))), "pt") as f:  # the fp32 merge: no bf16 rounding
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    try:
        import vllm  # noqa: F401
    except ImportError:
        for way in ("vllm-merged", "vllm-merged-fp32", "vllm-16bit-lora"):
            assert "vllm" in ways[way]["error"], way
        assert "failed" in done.stdout


def test_the_16bit_lora_way_loads_the_16bit_model_itself(tiny_dir):
    serve = load_peer("serve_vllm")
    assert serve.base_dir(str(tiny_dir)) == str(tiny_dir)  # a directory (or hub id) is vLLM's to load
    assert set(serve.VLLM_WAYS) == {w for w in serve.WAYS if w.startswith("vllm")}


def test_scores_read_the_requested_style():
    rows = [{"answer": "#### 18"}, {"answer": "#### 7"}]
    got = load_peer("serve_vllm").scores(["so 18\n#### 18", "the answer is \\boxed{7}"], rows, "gsm8k")
    assert got == [{"flexible": 1.0, "strict": 1.0}, {"flexible": 1.0, "strict": 0.0}]
